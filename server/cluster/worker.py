"""A worker process: one engine, in the prefill or the decode role, with an internal API.

A worker is the ordinary server (its public API still answers) plus the internal routes of
:mod:`server.cluster.messages`::

    prefill worker: the family's base model only
        POST /internal/prefill   prefill a prefix (or find it cached), ship blocks first_block..
                                 to a decode worker as they are committed; answer once acked
    decode worker: the base plus its agents' modules, and a KV receiver (tcp:// and shm://)
        POST /internal/kv/expect register the prefix blocks it lacks as arriving; requests that
                                 need them wait for them (or, if the transfer fails, compute them)
        POST /internal/generate  run a request; NDJSON events, as the engine emits them

Every ``/internal/...`` route needs the cluster secret's token (``X-Agentshare-Cluster``) and
every KV frame its HMAC; calls and connections without them are refused and counted
(``refused_requests``, ``refused_frames`` in the stats; ``agentshare_cluster_refused_total`` in
``/metrics``). The public API answers as on any server (with its API keys).

Faults for tests are injected with ``AGENTSHARE_FAULT`` (``kill_after_chunks=N``: the process
exits right after sending its N-th chunk; ``corrupt_chunk=N``: flip a payload byte of chunk N
after its checksum was taken).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, Metric

from server import tracing
from server.api.errors import ApiError
from server.backend import EngineFacts, EngineSnapshot
from server.cluster import codecs
from server.cluster.auth import HEADER, ClusterSecret
from server.cluster.codec import Frame, decode, encode, is_lossy
from server.cluster.errors import CorruptPayload, TransferError
from server.cluster.handoff import Inbound, Outbound
from server.cluster.messages import (
    Cached,
    Context,
    Event,
    Expect,
    Expected,
    Explain,
    Generate,
    LinkFigures,
    Lookup,
    Prefill,
    Prefilled,
    RemoteError,
    Report,
    Role,
    TransferRef,
    WorkerInfo,
    WorkerStats,
)
from server.cluster.transport import KVReceiver, LinkStats, open_sender
from server.engine.async_engine import AsyncEngine
from server.engine.core import EngineCore
from server.engine.errors import EngineError, InvalidRequest
from server.engine.sequence import FinishReason

log = logging.getLogger("agentshare.cluster")


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Injected faults (tests only), from ``AGENTSHARE_FAULT="kill_after_chunks=1,corrupt_chunk=0"``.

    >>> FaultPlan.parse("kill_after_chunks=2, corrupt_chunk=0")
    FaultPlan(kill_after_chunks=2, corrupt_chunk=0)
    """

    kill_after_chunks: int | None = None
    corrupt_chunk: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> FaultPlan:
        fields: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            name, _, value = part.partition("=")
            if name not in ("kill_after_chunks", "corrupt_chunk") or not value.isdigit():
                raise ValueError(f"AGENTSHARE_FAULT: unknown fault {part!r}")
            fields[name] = int(value)
        return cls(**fields)


@dataclass(slots=True)
class Counters:
    exported_blocks: int = 0
    imported_blocks: int = 0
    imported_tokens: dict[str, int] = field(default_factory=dict)  # by payload codec
    transfers_ok: int = 0
    transfers_failed: int = 0
    checksum_failures: int = 0
    refused_requests: int = 0  # internal calls without the cluster secret
    sent: dict[str, LinkStats] = field(default_factory=dict)


class Worker:
    """The internal API of one worker process (an app plugin: routes plus start/stop)."""

    def __init__(
        self, engine: AsyncEngine, *, role: Role, url: str, threads: int, secret: ClusterSecret,
        kv_host: str = "127.0.0.1", kv_port: int = 0, chunk_blocks: int = 32, faults: FaultPlan = FaultPlan(),
        join: str | None = None,
    ) -> None:
        """``secret``: the cluster's (the router and the other workers hold it too). ``join``: a
        router's URL to announce this worker to (a worker on another host)."""
        self.engine, self.role, self.url, self.threads = engine, role, url, threads
        self.secret = secret
        self.facts = EngineFacts.of(engine.core)
        self.kv_dtype = engine.core.kv.spec.dtype
        self.chunk_blocks, self.faults = chunk_blocks, faults
        self.counters = Counters()
        self._chunks_sent = 0  # by this process, for the injected faults
        self.inbound: dict[str, Inbound] = {}
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._codecs: dict[str, str] = {}  # transfer -> its sender's payload codec
        self.receiver = KVReceiver(self, key=secret.kv_key(), host=kv_host, port=kv_port) if role == "decode" else None
        self.router = self._routes()
        self.join = join
        self._join_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.receiver is not None:
            await self.receiver.start()
        if self.join:
            self._join_task = asyncio.create_task(self._join_loop(self.join))

    async def stop(self) -> None:
        if self._join_task is not None:
            self._join_task.cancel()
        if self.receiver is not None:
            await self.receiver.close()

    async def _join_loop(self, router: str, every: float = 5.0) -> None:
        """Tell the router where this worker is, and again every ``every`` seconds (idempotent),
        so a restarted router finds it too."""
        async with httpx.AsyncClient(timeout=5.0, headers=self.secret.headers()) as client:
            while True:
                try:
                    r = await client.post(f"{router.rstrip('/')}/internal/workers", json={"url": self.url})
                    if r.status_code >= 400:
                        log.error("the router refused this worker", extra={"event": "join_refused", "error": r.text})
                except httpx.HTTPError as exc:
                    log.warning("router unreachable", extra={"event": "join_failed", "router": router, "error": str(exc)})
                await asyncio.sleep(every)

    # ---- facts -----------------------------------------------------------------------------

    def info(self) -> WorkerInfo:
        spec = self.engine.core.kv.spec
        address = self._kv_address()
        return WorkerInfo(
            role=self.role, url=self.url, family=self.facts.family, agents=[c.info() for c in self.facts.agents.values()],
            block_size=self.facts.block_size, max_context=self.facts.max_context,
            kv_dtype=str(spec.dtype).removeprefix("torch."), kv_bytes_per_token=spec.bytes_per_token(),
            kv_address=address, threads=self.threads, pid=os.getpid(), hidden_depths=sorted(self.engine.core.kv.hidden),
        )

    def _kv_address(self) -> dict[str, str]:
        """Where senders reach the KV receiver: the host this worker is reached at (its URL), not
        the address it listens on (``0.0.0.0`` is no address for another host)."""
        if self.receiver is None:
            return {}
        host = urlsplit(self.url).hostname or self.receiver.host
        return {k: f"{k}://{host}:{self.receiver.port}" for k in ("tcp", "shm")}

    async def stats(self) -> WorkerStats:
        snap, rate = await self.engine.run(lambda core: (EngineSnapshot.of(core), core.stats.prefill_tok_s))
        c = self.counters
        received = self.receiver.stats if self.receiver else {}
        return WorkerStats(
            role=self.role, **dataclasses.asdict(snap),  # every engine counter, whole (a test pins the fields)
            exported_blocks=c.exported_blocks, imported_blocks=c.imported_blocks,
            imported_tokens=dict(c.imported_tokens), transfers_ok=c.transfers_ok,
            transfers_failed=c.transfers_failed, checksum_failures=c.checksum_failures, prefill_tok_s=rate,
            refused_requests=c.refused_requests, refused_frames=self.receiver.refused if self.receiver else 0,
            sent={k: _figures(v) for k, v in c.sent.items()}, received={k: _figures(v) for k, v in received.items()},
        )

    async def lookup(self, body: Lookup) -> Cached:
        def query(core: Any) -> Cached:
            layout = core.prefix_layout(salt=body.salt, prefix_codec=body.prefix_codec)
            match = core.pool.match(body.token_ids, layout)
            u = core.pool.usage()
            return Cached(cached_tokens=match.num_cached_tokens, waiting=len(core.waiting), running=len(core.running),
                          occupancy=u.held / u.capacity if u.capacity else 0.0)

        return await self.engine.run(query)

    async def explain(self, body: Explain) -> Report:
        match = await self.engine.run(lambda core: core.explain(body.module, body.prompt.prompt(), salt=body.salt))
        return Report(block_size=match.block_size, blocks=match.num_blocks, cached_blocks=len(match.block_ids))

    # ---- decode role: receiving KV -----------------------------------------------------------

    async def expect(self, body: Expect) -> Expected:
        self._require("decode")
        if body.transfer_id in self.inbound:
            raise InvalidRequest(f"transfer {body.transfer_id!r} is already expected")
        inbound = await self.engine.run(lambda core: Inbound.expect(
            core, body.transfer_id, body.token_ids, salt=body.salt, prefix_codec=body.prefix_codec,
            ttl=body.timeout, hidden=body.hidden))
        assert self.receiver is not None
        if inbound.num_blocks == 0:
            await self.engine.run(inbound.finish)
        else:
            self.inbound[body.transfer_id] = inbound
            loop = asyncio.get_running_loop()
            self._deadlines[body.transfer_id] = loop.call_later(
                body.timeout, lambda: asyncio.ensure_future(self._close(body.transfer_id, "timed out")))
        return Expected(transfer_id=body.transfer_id, first_block=inbound.first_block, num_blocks=inbound.num_blocks,
                        address=self._kv_address())

    async def abort(self, body: TransferRef) -> None:
        await self._close(body.transfer_id, body.reason or "aborted by the router")

    async def on_open(self, transfer_id: str, header: dict[str, Any]) -> None:
        inbound = self.inbound.get(transfer_id)
        if inbound is None:
            raise InvalidRequest(f"no transfer {transfer_id!r} is expected here (unknown, finished or timed out)")
        codec = codecs.get(header.get("codec", "fp32")).name
        lossy = codec if is_lossy(codec, self.kv_dtype) else None
        if lossy != inbound.prefix_codec:
            raise InvalidRequest(f"transfer {transfer_id!r} was expected as {inbound.prefix_codec or 'exact'}, "
                                 f"the sender uses {codec}")
        tracing.begin(transfer_id, "kv.receive", parent=header.get("meta"), transfer_id=transfer_id, codec=codec,
                      blocks=inbound.num_blocks)
        self._codecs[transfer_id] = codec

    async def on_frame(self, transfer_id: str, frame: Frame) -> None:
        inbound = self.inbound.get(transfer_id)
        if inbound is None:
            raise InvalidRequest(f"transfer {transfer_id!r} is closed")
        try:
            chunk = await asyncio.to_thread(decode, frame, dtype=self.kv_dtype)
        except CorruptPayload:
            self.counters.checksum_failures += 1
            raise
        n = await self.engine.run(lambda core: inbound.write(core, chunk))
        self.counters.imported_blocks += n
        codec = self._codecs.get(transfer_id, "fp32")
        self.counters.imported_tokens[codec] = self.counters.imported_tokens.get(codec, 0) + n * self.facts.block_size

    async def on_end(self, transfer_id: str, error: str | None) -> None:
        inbound = self.inbound.get(transfer_id)
        if error is None and inbound is not None and not inbound.complete:
            error = f"the sender ended after {inbound.written} of {inbound.num_blocks} blocks"
        await self._close(transfer_id, error)

    async def _close(self, transfer_id: str, error: str | None) -> None:
        inbound = self.inbound.pop(transfer_id, None)
        self._codecs.pop(transfer_id, None)
        timer = self._deadlines.pop(transfer_id, None)
        if timer is not None:
            timer.cancel()
        if inbound is None:
            return
        await self.engine.run(inbound.finish)
        tracing.finish(transfer_id, error=error, written_blocks=inbound.written)
        if error is None:
            self.counters.transfers_ok += 1
        else:
            self.counters.transfers_failed += 1
            log.warning("transfer failed", extra={"event": "transfer_failed", "transfer": transfer_id,
                                                  "error": error, "written": inbound.written,
                                                  "expected": inbound.num_blocks})

    # ---- prefill role: sending KV ------------------------------------------------------------

    async def prefill(self, body: Prefill) -> Prefilled:
        self._require("prefill")
        codec = codecs.get(body.codec).name
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        out = await self.engine.run(lambda core: Outbound.start(
            core, body.transfer_id, body.token_ids, salt=body.salt, first_block=body.first_block,
            chunk_blocks=self.chunk_blocks, ttl=600.0, loop=loop, hidden_depths=tuple(body.hidden_depths)))
        await self.engine.add_step_hook(out.on_step)
        sender = None
        blocks = 0
        try:
            sender = await open_sender(body.destination, body.transfer_id, codec=codec, key=self.secret.kv_key(),
                                       meta=tracing.headers())  # the receiver's span continues this trace
            while (item := await out.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                frame = await asyncio.to_thread(encode, item, codec, block_size=self.facts.block_size)
                frame = self._inject(frame)
                await sender.send(frame)
                blocks += item.k.shape[2] // self.facts.block_size
                self._maybe_die()
            await sender.finish()
        except BaseException as exc:
            self.counters.transfers_failed += 1
            if sender is not None:
                await sender.abort(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            await self.engine.remove_step_hook(out.on_step)
            await self.engine.run(lambda core: _drop(core, body.transfer_id))
            if sender is not None:
                link = self.counters.sent.setdefault(body.destination, LinkStats())
                _add(link, sender.stats)
        self.counters.transfers_ok += 1
        self.counters.exported_blocks += blocks
        tracing.annotate(transfer_id=body.transfer_id, blocks=blocks, bytes=sender.stats.bytes, codec=codec,
                         computed_tokens=out.computed_tokens, cached_tokens=out.cached_tokens)
        return Prefilled(transfer_id=body.transfer_id, blocks=blocks, bytes=sender.stats.bytes,
                         seconds=time.monotonic() - start, link_seconds=sender.stats.seconds, computed_tokens=out.computed_tokens,
                         cached_tokens=out.cached_tokens)

    def _inject(self, frame: Frame) -> Frame:
        self._chunks_sent += 1
        if self.faults.corrupt_chunk is not None and self._chunks_sent - 1 == self.faults.corrupt_chunk:
            payload = bytearray(frame.payload)
            payload[len(payload) // 2] ^= 0xFF  # after the checksum was taken: the receiver must notice
            return Frame(frame.header, payload)
        return frame

    def _maybe_die(self) -> None:
        if self.faults.kill_after_chunks is not None and self._chunks_sent >= self.faults.kill_after_chunks:
            log.error("injected fault: exiting mid-transfer", extra={"event": "fault", "chunks": self._chunks_sent})
            os._exit(17)

    async def add_context(self, body: Context) -> Event:
        done = await self.engine.add_context(body.context_id, body.token_ids, ttl=body.ttl, salt=body.salt)
        return Event.of(done)

    async def release_context(self, context_id: str) -> bool:
        return await self.engine.run(lambda core: core.release_context(context_id))

    # ---- decode role: generating -------------------------------------------------------------

    async def generate(self, body: Generate) -> Response:
        self._require("decode")
        span, arrival = tracing.current(), time.time_ns()  # its queue, prefill and decode: child spans
        stream = await self.engine.submit(body.request_id, body.module, body.prompt.prompt(), body.params.params(),
                                          salt=body.salt, prefix_codec=body.prefix_codec)

        async def lines() -> Any:
            try:
                async for ev in stream:
                    if ev.finish_reason is not None:
                        tracing.engine_spans(span, ev.timeline, arrival)
                    yield Event.of(ev).model_dump_json() + "\n"
            except Exception as exc:  # this request's failure, not the worker's: end it with an error
                log.exception("a generate stream failed", extra={"event": "request_failed", "request": body.request_id})
                yield Event(finish_reason=FinishReason.ERROR.value, error=f"{type(exc).__name__}: {exc}").model_dump_json() + "\n"
            finally:
                stream.cancel()  # the router went away: free the KV

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def _require(self, role: Role) -> None:
        if self.role != role:
            raise InvalidRequest(f"this is a {self.role} worker; that call goes to a {role} worker")

    # ---- routes ------------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        """A route dependency: the call carries the cluster secret's token, or gets 401."""
        if not self.secret.check(request.headers.get(HEADER)):
            self.counters.refused_requests += 1
            log.warning("internal call refused", extra={"event": "internal_refused", "path": request.url.path,
                                                        "peer": request.client.host if request.client else ""})
            raise ApiError(401, f"internal endpoints need the cluster secret: send its token in {HEADER} "
                           "(the launcher and --cluster-secret-file give it to router and workers)",
                           type="authentication_error", code="invalid_cluster_secret")

    def collect(self) -> Iterator[Metric]:
        """The worker's own Prometheus figures (the app registers ``collector``)."""
        refused = CounterMetricFamily("agentshare_cluster_refused", "Internal calls and KV connections refused "
                                      "for want of the cluster secret", labels=["channel"])
        refused.add_metric(["http"], self.counters.refused_requests)
        refused.add_metric(["kv"], self.receiver.refused if self.receiver else 0)
        yield refused

    @property
    def collector(self) -> Worker:
        return self

    def _routes(self) -> APIRouter:
        r = APIRouter(prefix="/internal", include_in_schema=False, dependencies=[Depends(self.authorize)])
        w = self

        async def call(fn: Any, *args: Any) -> Any:
            try:
                return await fn(*args)
            except (EngineError, TransferError, ValueError) as exc:
                err = RemoteError.of(exc)
                return JSONResponse(err.model_dump(), status_code=err.status if isinstance(exc, EngineError) else 502)

        @r.get("/info")
        async def info() -> WorkerInfo:
            return w.info()

        @r.get("/stats")
        async def stats() -> WorkerStats:
            return await w.stats()

        @r.post("/lookup")
        async def lookup(body: Lookup) -> Any:
            return await call(w.lookup, body)

        @r.post("/explain")
        async def explain(body: Explain) -> Any:
            return await call(w.explain, body)

        @r.post("/kv/expect")
        async def expect(body: Expect) -> Any:
            return await call(w.expect, body)

        @r.post("/kv/abort", status_code=204)
        async def abort(body: TransferRef) -> None:
            await w.abort(body)

        @r.post("/prefill")
        async def prefill(body: Prefill) -> Any:
            return await call(w.prefill, body)

        @r.post("/contexts")
        async def add_context(body: Context) -> Any:
            return await call(w.add_context, body)

        @r.delete("/contexts/{context_id:path}")
        async def release_context(context_id: str) -> bool:
            return await w.release_context(context_id)

        @r.post("/generate")
        async def generate(body: Generate, request: Request) -> Any:
            request.state.log = {**getattr(request.state, "log", {}), "request_id": body.request_id}
            return await call(w.generate, body)

        return r


def _drop(core: EngineCore, transfer_id: str) -> None:
    """The transfer is over: stop its prefill if it still runs, else unpin its blocks (they stay
    cached, so the next request for this prefix finds them)."""
    if core.cancel(transfer_id) is None:
        core.release_context(transfer_id)


def _figures(s: LinkStats) -> LinkFigures:
    return LinkFigures(bytes=s.bytes, frames=s.frames, transfers=s.transfers, failures=s.failures, seconds=s.seconds)


def _add(total: LinkStats, s: LinkStats) -> None:
    total.bytes += s.bytes
    total.frames += s.frames
    total.transfers += s.transfers
    total.failures += s.failures
    total.seconds += s.seconds

