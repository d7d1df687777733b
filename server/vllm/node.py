"""``agentshare vllm-node``: agents' vLLM instances on another host, fed by the frontend's base.

A frontend (``agentshare serve --engine vllm --node URL``) runs the base instance, computes every
shared prefix once and serves its own agents. A node runs the instances of more agents on its
host (no base of its own) beside a KV store and a KV receiver; the frontend routes those agents'
requests to it and pushes the prefix blocks the node lacks first (:mod:`server.vllm.relay`)::

    frontend (host A)                                  node (host B): agentshare vllm-node
    base prefill ─▶ store A
    GET  /internal/vllm/info ───────────────────────▶ family, KV format, agents, receiver address
    POST /internal/vllm/lookup (pins the prefix) ───▶ the leading blocks store B holds
    push the others over TCP ───────────────────────▶ KVReceiver ─▶ store B
    POST /internal/vllm/completions ────────────────▶ the agent's instance loads the prefix from
         ◀── SSE, as vLLM streams it ─────────────── store B, computes from the IP on; unpin

Every ``/internal/...`` call needs the cluster secret's token (``X-Agentshare-Cluster``) and every
KV frame its HMAC (the frontend and the node read the same ``--cluster-secret-file``); the
instances listen on ``127.0.0.1`` only. ``/health`` answers 503 while an instance is down.

The frontend's side is :class:`NodeClient`: it reads the node's facts once, then polls them (for
``/health``), and moves prefixes and requests to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.api.errors import ApiError, install_error_handlers
from server.backend import AgentCard
from server.cluster.auth import HEADER, ClusterSecret
from server.cluster.transport import KVReceiver
from server.vllm.launch import VllmInstances, agent_card
from server.vllm.relay import Pushed, StoreReceiver, push_blocks, transfer_codec
from server.vllm.store import KVStore, StoreBlock

log = logging.getLogger("agentshare.vllm.node")

_KNOWN_BLOCKS = 1 << 16  # block keys a frontend remembers per node, for placement

PIN_HEADER = "X-Agentshare-Pin"
"""On ``/internal/vllm/completions``: the pin the node drops once the request has ended."""


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What a node tells a frontend: ``/internal/vllm/info``."""

    family: str
    fmt: str
    block_size: int
    kv_dtype: str
    kv_address: str
    agents: dict[str, dict[str, Any]]  # name -> AgentCard fields and "instance"
    down: list[str]


class Node:
    """The node's state: its started instances, their store, the receiver that fills it."""

    def __init__(self, instances: VllmInstances, store: KVStore, facts: dict[str, object], *, family: str,
                 modules: dict[str, Path], secret: ClusterSecret, kv_host: str, kv_port: int = 0,
                 advertise: str | None = None) -> None:
        self.instances, self.store, self.family, self.secret = instances, store, family, secret
        self.block_size = int(facts["block_size"])  # type: ignore[call-overload]
        self.kv_dtype = str(facts.get("dtype", ""))
        transfer_codec(self.kv_dtype)  # refuse now a dtype that cannot move losslessly
        self.handler = StoreReceiver(store, store.fmt)
        self.receiver = KVReceiver(self.handler, key=secret.kv_key(), host=kv_host, port=kv_port)
        self.advertise = advertise or kv_host
        self.routes: dict[str, tuple[str, AgentCard]] = {}
        for inst in instances.instances.values():
            for name in inst.spec.modules:
                if name in modules:
                    self.routes[name] = (inst.spec.name, agent_card(modules[name], name=name, family=family))
        self._http: httpx.AsyncClient | None = None

    def facts(self) -> NodeFacts:
        return NodeFacts(self.family, self.store.fmt, self.block_size, self.kv_dtype,
                         f"tcp://{self.advertise}:{self.receiver.port}",
                         {n: {**asdict(card), "instance": inst} for n, (inst, card) in self.routes.items()},
                         self.instances.down())

    async def start(self) -> None:
        await self.receiver.start()
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        log.info("node", extra={"event": "vllm_node", "kv_address": self.facts().kv_address,
                                "agents": ",".join(self.routes), "store": str(self.store.dir)})

    async def stop(self) -> None:
        await self.receiver.close()
        if self._http is not None:
            await self._http.aclose()

    def close(self) -> None:
        self.instances.close()

    async def completions(self, body: dict[str, Any], pin: str | None) -> Response:
        """Stream the request from the instance of ``body["model"]``; drop ``pin`` once it ends."""
        route = self.routes.get(str(body.get("model")))
        if route is None:
            if pin:
                self.store.unpin(pin)
            raise ApiError(404, f"this node serves no agent {body.get('model')!r}; it serves "
                                f"{', '.join(self.routes)}", code="model_not_found")
        assert self._http is not None
        url = self.instances[route[0]].url + "/v1/completions"
        try:
            resp = await self._http.send(self._http.build_request("POST", url, json=body), stream=True)
        except BaseException:
            if pin:
                self.store.unpin(pin)
            raise

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()  # the frontend went away: vLLM aborts the request
                if pin:
                    self.store.unpin(pin)

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "text/event-stream"))

    def lookup(self, keys: Sequence[str], pin: str, ttl: float) -> int:
        """Pin ``keys`` (hex) under ``pin`` for ``ttl`` seconds, then say how many of them, from the
        first, the store holds: pinned first, none of those can be evicted before the request ends."""
        raw = [bytes.fromhex(k) for k in keys]
        self.store.pin(pin, raw, ttl=ttl)
        return self.store.held_prefix(raw)

    def stats(self) -> dict[str, Any]:
        blocks, held = self.store.usage()
        links = {k: asdict(v) for k, v in self.receiver.stats.items()}
        pins = sum(1 for p in self.store.pins.iterdir() if not p.name.startswith("."))
        return {"store": asdict(self.store.counters_total()), "blocks_held": blocks, "bytes_held": held, "pins": pins,
                "received_blocks": self.handler.received_blocks, "received_bytes": self.handler.received_bytes,
                "failed_transfers": self.handler.failed_transfers, "refused_connections": self.receiver.refused,
                "links": links, "down": self.instances.down()}

    async def metrics(self) -> dict[str, str]:
        """Every ready instance's own ``/metrics`` text, by instance."""
        assert self._http is not None
        out: dict[str, str] = {}
        for name, inst in self.instances.instances.items():
            if inst.ready:
                with contextlib.suppress(httpx.HTTPError):
                    out[name] = (await self._http.get(inst.url + "/metrics", timeout=5)).text
        return out


def create_node_app(node: Node) -> FastAPI:
    """The node's HTTP API (see the module docstring)."""

    def authorized(request: Request) -> None:
        if not node.secret.check(request.headers.get(HEADER)):
            raise ApiError(401, f"node calls need the cluster secret's {HEADER} header", type="authentication_error")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await node.start()
        try:
            yield
        finally:
            await node.stop()

    app = FastAPI(title="agentshare vllm-node", lifespan=lifespan)
    install_error_handlers(app)
    internal = APIRouter(prefix="/internal/vllm", dependencies=[Depends(authorized)])

    @internal.get("/info")
    async def info() -> dict[str, Any]:
        return asdict(node.facts())

    @internal.post("/lookup")
    async def lookup(request: Request) -> dict[str, int]:
        body = await request.json()
        keys, pin, ttl = body.get("keys"), body.get("pin"), body.get("ttl")
        if (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or not isinstance(pin, str)
                or not isinstance(ttl, int | float)):
            raise ApiError(422, "lookup takes {keys: [hex, ...], pin: str, ttl: seconds}")
        try:
            return {"held": await asyncio.to_thread(node.lookup, keys, pin, float(ttl))}
        except ValueError as exc:
            raise ApiError(422, f"bad lookup: {exc}") from None

    @internal.post("/completions")
    async def completions(request: Request) -> Response:
        return await node.completions(await request.json(), request.headers.get(PIN_HEADER))

    @internal.get("/stats")
    async def stats() -> dict[str, Any]:
        return await asyncio.to_thread(node.stats)

    @internal.get("/metrics")
    async def metrics() -> dict[str, str]:
        return await node.metrics()

    app.include_router(internal)

    @app.get("/health")
    async def health() -> Response:
        down = node.instances.down()
        return JSONResponse({"status": "ok" if not down else "degraded", "down": down},
                            status_code=200 if not down else 503)

    return app


class NodeClient:
    """A frontend's view of one node: its facts, whether it answers, and moving work to it."""

    def __init__(self, url: str, facts: NodeFacts, secret: ClusterSecret, *, name: str) -> None:
        self.url, self.facts, self.secret, self.name = url.rstrip("/"), facts, secret, name
        self.reachable = True
        self.down: list[str] = list(facts.down)
        self.pushed = {"transfers": 0, "blocks": 0, "bytes": 0, "seconds": 0.0, "failures": 0}
        self.codec = transfer_codec(facts.kv_dtype)
        self._known: OrderedDict[bytes, None] = OrderedDict()  # blocks it held lately (affinity only)
        self._flights: dict[bytes, asyncio.Future[None]] = {}  # pushes under way, by their last block
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"vllm-{name}", daemon=True)

    @classmethod
    def connect(cls, url: str, secret: ClusterSecret, *, name: str, timeout: float = 900.0) -> NodeClient:
        """Wait (up to ``timeout`` s) until the node at ``url`` serves, then read its facts."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(url.rstrip("/") + "/internal/vllm/info", headers=secret.headers(), timeout=5)
                if r.status_code == 200:
                    client = cls(url, NodeFacts(**r.json()), secret, name=name)
                    client._poller.start()
                    return client
                if r.status_code == 401:
                    raise ValueError(f"the node at {url} refused this frontend's cluster secret: give both the same "
                                     "--cluster-secret-file")
            except httpx.HTTPError as exc:
                err: str = str(exc) or type(exc).__name__
            else:
                err = f"HTTP {r.status_code}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"the node at {url} did not answer within {timeout:g} s ({err})")
            time.sleep(1.0)

    def holds(self, key: bytes) -> bool:
        """Whether the node held block ``key`` when this frontend last sent or found it there: a
        hint for placement (it may have evicted it since; the lookup before a request is exact)."""
        return key in self._known

    def _learn(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._known[k] = None
            self._known.move_to_end(k)
        while len(self._known) > _KNOWN_BLOCKS:
            self._known.popitem(last=False)

    def headers(self, pin: str | None = None) -> dict[str, str]:
        return {**self.secret.headers(), **({PIN_HEADER: pin} if pin else {})}

    def _poll(self) -> None:
        while not self._closed.wait(2.0):
            try:
                r = httpx.get(self.url + "/internal/vllm/info", headers=self.secret.headers(), timeout=2)
                r.raise_for_status()
                self.down, self.reachable = list(r.json()["down"]), True
            except (httpx.HTTPError, KeyError, ValueError):
                self.reachable = False

    def issues(self) -> list[str]:
        if not self.reachable:
            return [f"vllm node {self.name} ({self.url}) does not answer"]
        return [f"vllm instance {self.name}/{n} is not serving" for n in self.down]

    async def send_prefix(self, http: httpx.AsyncClient, store: KVStore, blocks: Sequence[StoreBlock],
                          tokens: Sequence[int], *, pin: str, ttl: float) -> Pushed:
        """Make the node's store hold ``blocks`` (pinned under ``pin``): send those it lacks. A
        request that finds the same prefix on its way there waits for that push, then sends what
        is still missing (nothing, unless that push failed)."""
        keys = [b.key for b in blocks]
        held = await self._lookup(http, keys, pin, ttl)
        flight = self._flights.get(keys[-1]) if keys and held < len(keys) else None
        if flight is not None:
            with contextlib.suppress(Exception):  # its failure is its own; this request tries itself
                await asyncio.shield(flight)
            held = await self._lookup(http, keys, pin, ttl)
        fut: asyncio.Future[None] | None = None
        if keys and held < len(keys):
            fut = self._flights[keys[-1]] = asyncio.get_running_loop().create_future()
        try:
            pushed = await push_blocks(store, blocks[held:], tokens, address=self.facts.kv_address,
                                       key=self.secret.kv_key(), fmt=self.facts.fmt, codec=self.codec, pin=pin,
                                       ttl=ttl, transfer_id=uuid.uuid4().hex, keys=keys)
        except BaseException as exc:
            self.pushed["failures"] += 1
            if fut is not None:
                fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError("push cancelled"))
                fut.exception()  # retrieved: no warning when nobody waits on it
            raise
        finally:
            if fut is not None:
                if not fut.done():
                    fut.set_result(None)
                if self._flights.get(keys[-1]) is fut:
                    del self._flights[keys[-1]]
        self._learn(keys)
        p = self.pushed
        p["transfers"] += 1
        p["blocks"] += pushed.blocks
        p["bytes"] += pushed.bytes
        p["seconds"] += pushed.seconds
        return pushed

    async def _lookup(self, http: httpx.AsyncClient, keys: Sequence[bytes], pin: str, ttl: float) -> int:
        """Pin ``keys`` on the node; how many of them, from the first, it holds."""
        r = await http.post(self.url + "/internal/vllm/lookup", headers=self.headers(), timeout=30,
                            json={"keys": [k.hex() for k in keys], "pin": pin, "ttl": ttl})
        r.raise_for_status()
        return int(r.json()["held"])

    async def stats(self, http: httpx.AsyncClient) -> dict[str, Any] | None:
        try:
            r = await http.get(self.url + "/internal/vllm/stats", headers=self.headers(), timeout=5)
            r.raise_for_status()
            return dict(r.json())
        except httpx.HTTPError:
            return None

    def close(self) -> None:
        self._closed.set()
