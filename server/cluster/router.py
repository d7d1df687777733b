"""The router: the API's backend when prefill and decode run in other processes.

Per request (``submit``), with the placement policies of :mod:`server.policy`::

    card ─ IP ─▶ shared prefix = the full blocks before the IP (none for a foreign module)
    lookup on the decode workers holding the agent's module, and on the prefill workers
    place(request, cluster snapshot, offload policy)      ─▶ decode worker D, and
        LOCAL  : D prefills the prefix itself (short incremental prefill, saturated link, ...)
        REMOTE : D expects the blocks it lacks ─▶ prefill worker P computes (or finds) them and
                 streams them to D; D's request waits on those blocks, not on the whole transfer
    D /internal/generate ─▶ NDJSON events ─▶ the same TokenEvents the local engine yields; the
                 final one's timeline gets the router's part: the route's reason, the placement
                 time, and the transfer (bytes, link seconds, codec; its blocks count as imported)

Faults::

    P dies or fails      the transfer breaks: D aborts the blocks not yet written, and the
                         request waiting on them computes them itself (nothing lost, nothing
                         unwritten served); the router aborts the expectation too, marks P down
    D dies               before any token: the request is retried on another decode worker
                         holding the module; after a token: it ends with an error event
    any worker           a health loop polls ``/internal/stats``; a worker that answers again
                         (restarted, or joining by URL from another host) rejoins

Every call to a worker carries the cluster secret's token; a worker joins (``/internal/workers``)
only with it. ``/internal/cluster`` (every worker's counters) needs the admin key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from server import positions, tracing
from server.api.errors import ApiError
from server.backend import (
    AgentCard,
    CacheReport,
    EngineFacts,
    EngineSnapshot,
    EventSource,
    HealthReport,
)
from server.cluster import codecs
from server.cluster.auth import HEADER, ClusterSecret, check_admin
from server.cluster.codec import is_lossy
from server.cluster.members import Member, WorkerDown, check_worker, facts_of
from server.cluster.messages import (
    Cached,
    Context,
    Event,
    Expect,
    Expected,
    Explain,
    Generate,
    Join,
    Lookup,
    Prefill,
    Prefilled,
    PromptFields,
    RemoteError,
    Report,
    SamplingFields,
    TransferRef,
    WorkerInfo,
    WorkerStats,
)
from server.cluster.metrics import RouterCollector, RouterStats
from server.cluster.stream import ClusterStream
from server.engine.errors import InvalidRequest, Unavailable, UnknownModule
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
from server.policy import (
    ClusterSnapshot,
    LinkSnapshot,
    OffloadPolicy,
    RequestSnapshot,
    Role,
    WorkerSnapshot,
    place,
    placement,
)
from server.policy.offload import RouteDecision, Where
from server.prompt import Prompt

log = logging.getLogger("agentshare.cluster")

@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """How the router places and moves work."""

    policy: OffloadPolicy = OffloadPolicy(threshold_tokens=256)
    """The placement knobs (offload threshold, bandwidth-awareness, affinity)."""
    placement_policy: str = placement.DEFAULT
    """The placement policy's registered name (:mod:`server.policy.placement`)."""
    codec: str = "bf16"
    """Payload of KV transfers, a registered codec's name (:mod:`server.cluster.codecs`); a lossy one
    (int8, or bf16 from an fp32 engine) puts the moved blocks in the family's lossy namespace."""
    transport: str = "auto"
    """shm, tcp, or auto: shared memory between workers reached at the same host name, else TCP."""
    health_interval: float = 0.5
    connect_timeout: float = 120.0  # waiting for the workers at start-up
    transfer_timeout: float = 60.0
    prefill_tok_s: float = 1000.0  # a worker's prefill throughput until it has measured its own
    link_bytes_s: float = 1e9  # a link's bandwidth until a transfer measured it

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"transport must be auto, shm or tcp, got {self.transport!r}")
        placement.get(self.placement_policy)  # UnknownPolicy / UnknownCodec list the registered names
        object.__setattr__(self, "codec", codecs.get(self.codec).name)


@dataclass(frozen=True, slots=True)
class _Route:
    """Where the router sent one request: its placement reason, where its prefix was prefilled
    (``"local"`` or the prefill worker's URL), how long placing it took, and its transfer."""

    reason: str
    prefill: str
    seconds: float
    transfer: asyncio.Task[Prefilled | None] | None = None
    codec: str | None = None

    async def stamp(self, ev: TokenEvent, timeout: float) -> TokenEvent:
        """``ev`` (a final event) with the router's part of its timeline: the route, and the
        transfer's figures once its prefill worker answered (the tokens imported are the decode
        worker's own count)."""
        t = ev.timeline
        if t is None:
            return ev
        t = dataclasses.replace(t, route=self.reason, prefill=self.prefill, route_s=self.seconds)
        if self.transfer is not None:
            await asyncio.wait({self.transfer}, timeout=timeout)  # never cancels it
            done = self.transfer.result() if self.transfer.done() and not self.transfer.cancelled() else None
            if done is not None:  # the decode worker counted the imported tokens; the link's figures
                t = dataclasses.replace(
                    t, remote_computed_tokens=min(t.imported_tokens, done.computed_tokens), transfer_bytes=done.bytes,
                    transfer_s=done.link_seconds, transfer_codec=self.codec)
        return dataclasses.replace(ev, timeline=t)


class ClusterBackend:
    """A :class:`~server.backend.Backend` over prefill and decode worker processes, and an
    app plugin (its membership routes and health loop). ``collector`` adds the router's own
    figures to the app's Prometheus metrics."""

    def __init__(
        self, facts: EngineFacts, members: Sequence[Member], config: RouterConfig = RouterConfig(), *,
        secret: ClusterSecret, admin_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``secret``: the cluster's (its token goes with every call to a worker). ``admin_key``:
        what ``/internal/cluster`` asks for (none: it answers no one). ``transport``: how to
        reach the workers (default: the network; tests pass a mock)."""
        self.facts, self.config, self._transport = facts, config, transport
        self.secret, self.admin_key = secret, admin_key
        self.members = list(members)
        self.stats = RouterStats()
        self._ids = itertools.count(len(self.members))
        self._requests = itertools.count(1)
        self._client: httpx.AsyncClient | None = None
        self._health: asyncio.Task[None] | None = None
        self._transfers: set[asyncio.Task[Any]] = set()
        self._contexts: dict[str, Member] = {}
        self.router = self._routes()
        self.collector = RouterCollector(self)

    # ---- start-up ------------------------------------------------------------------------------

    @classmethod
    def connect(
        cls, urls: Sequence[str], tokenizer: Any, config: RouterConfig = RouterConfig(), *, secret: ClusterSecret,
        admin_key: str | None = None,
    ) -> ClusterBackend:
        """Wait (blocking, up to ``config.connect_timeout``) until every worker answers, check
        that they serve one family, and build the API's facts from them."""
        deadline = time.monotonic() + config.connect_timeout
        infos: list[WorkerInfo] = []
        with httpx.Client(timeout=5.0, headers=secret.headers()) as client:
            for url in urls:
                while True:
                    try:
                        r = client.get(f"{url}/internal/info")
                        if r.status_code == 401:
                            raise Unavailable(f"worker {url} refused the cluster secret: give router and workers "
                                              "the same one (--cluster-secret-file)")
                        infos.append(WorkerInfo.model_validate(r.json()))
                        break
                    except (httpx.HTTPError, ValueError) as exc:
                        if time.monotonic() > deadline:
                            raise Unavailable(f"worker {url} did not come up within {config.connect_timeout:g} s: {exc}") from exc
                        time.sleep(0.2)
        members = [Member(i, url, info, alive=True) for i, (url, info) in enumerate(zip(urls, infos, strict=True))]
        return cls(facts_of(infos, tokenizer), members, config, secret=secret, admin_key=admin_key)

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0), transport=self._transport,
                                         headers=self.secret.headers())
        self._health = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
        for task in list(self._transfers):
            task.cancel()
        await asyncio.gather(*self._transfers, *(t for t in [self._health] if t), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    def close(self) -> None:
        """Workers are separate processes with their own life (the launcher stops them)."""

    # ---- the Backend ---------------------------------------------------------------------------

    async def submit(
        self, request_id: str, module: str, prompt: Prompt, params: SamplingParams, *, salt: str = ""
    ) -> EventSource:
        card = self.facts.agents.get(module)
        if card is None:
            raise UnknownModule(module, list(self.facts.agents))
        tried: set[int] = set()
        routes: list[_Route] = []  # the last attempt's is the one that serves it

        async def attempt() -> tuple[httpx.Response, Member]:
            while True:
                candidates = [m for m in self._alive("decode") if m.serves(module) and m.id not in tried]
                if not candidates:
                    raise Unavailable(f"no decode worker serving agent {module!r} is up; retry later")
                with tracing.span("route", request_id=request_id, agent=module) as sp:
                    member, prefix_codec, route = await self._route(request_id, card, prompt, salt, candidates)
                    sp.set_attributes({"reason": route.reason, "decode_worker": member.url, "prefill": route.prefill})
                routes.append(route)
                try:
                    return await self._generate(member, request_id, module, prompt, params, salt, prefix_codec), member
                except WorkerDown as exc:
                    self._down(member, exc)
                    tried.add(member.id)
                    self.stats.retries += 1

        async def stamp(ev: TokenEvent) -> TokenEvent:
            return await routes[-1].stamp(ev, self.config.transfer_timeout)

        response, member = await attempt()
        return ClusterStream(request_id, response, member, attempt, self._down, self.stats, finish=stamp)

    async def add_context(self, context_id: str, token_ids: SequenceOf[int], *, ttl: float, salt: str = "") -> TokenEvent:
        """Pin the context on a prefill worker (the one every decode worker can fetch it from);
        without one, on a decode worker."""
        targets = self._alive("prefill") or self._alive("decode")
        if not targets:
            raise Unavailable("no worker is up; retry later")
        member = min(targets, key=lambda m: m.queued_tokens)
        body = Context(context_id=context_id, token_ids=list(token_ids), ttl=ttl, salt=salt)
        event = Event.model_validate(await self._post(member, "/internal/contexts", body))
        if event.finish_reason == FinishReason.PREFILLED.value:
            self._contexts[context_id] = member
        return event.event(context_id)

    async def release_context(self, context_id: str) -> bool:
        member = self._contexts.pop(context_id, None)
        if member is None or not member.alive:
            return False
        assert self._client is not None
        try:
            r = await self._client.delete(f"{member.url}/internal/contexts/{context_id}")
        except httpx.TransportError:
            return False
        return bool(r.json())

    async def explain(self, module: str, prompt: Prompt, *, salt: str = "") -> CacheReport:
        candidates = [m for m in self._alive("decode") if m.serves(module)]
        if not candidates:
            raise Unavailable(f"no decode worker serving agent {module!r} is up")
        reports = await asyncio.gather(*(self._post(m, "/internal/explain", Explain(
            module=module, prompt=PromptFields.of(prompt), salt=salt)) for m in candidates))
        best = max((Report.model_validate(r) for r in reports), key=lambda r: r.cached_blocks)
        return CacheReport(best.block_size, best.blocks, best.cached_blocks)

    async def snapshot(self) -> EngineSnapshot:
        stats = await asyncio.gather(*(self._stats(m) for m in self._alive()), return_exceptions=True)
        total: dict[str, int] = {}
        for s in stats:
            if isinstance(s, WorkerStats):
                for name in EngineSnapshot.__dataclass_fields__:
                    total[name] = total.get(name, 0) + int(getattr(s, name, 0) or 0)
        return EngineSnapshot(**total)

    def health(self) -> HealthReport:
        """The live workers' queues as the health loop last read them; degraded for every agent
        that no live decode worker serves (its requests get 503 until one is back)."""
        stats = [m.stats for m in self._alive() if m.stats is not None]
        decode = self._alive("decode")
        lost = [name for name in self.facts.agents if not any(m.serves(name) for m in decode)]
        return HealthReport(sum(s.waiting for s in stats), sum(s.running for s in stats),
                            tuple(f"no decode worker serving agent {name!r} is up" for name in lost))

    # ---- placement -----------------------------------------------------------------------------

    async def _route(
        self, request_id: str, card: AgentCard, prompt: Prompt, salt: str, candidates: list[Member]
    ) -> tuple[Member, str | None, _Route]:
        """Choose the decode worker and where its shared prefix comes from; start any transfer."""
        started = time.monotonic()
        bs = self.facts.block_size
        prefix = list(prompt.token_ids[: positions.shared_prefix_len(prompt, card, block_size=bs)])
        lossy = self._lossy_codec()
        prefill = self._alive("prefill") if prefix else []
        if card.recompute_layers:  # a layer-split agent fills its prefix only from blocks that carry
            # the base's hidden state at its split: blocks moved without it would spare it no layer
            prefill = [m for m in prefill if all(self._sends_hidden(m, d, lossy) for d in candidates)]
        looked = await asyncio.gather(*(self._lookup(m, prefix, salt) for m in candidates + prefill))
        cached = dict(zip([m.id for m in candidates + prefill], looked, strict=True))
        snapshot = ClusterSnapshot(
            self.facts.family, self._kv_bytes_per_token(),
            prefill=[self._snap(m, Role.PREFILL, cached[m.id]) for m in prefill],
            decode=[self._snap(m, Role.DECODE, cached[m.id]) for m in candidates],
            links=[LinkSnapshot(m.id, m.link_bytes_s or self.config.link_bytes_s, 0.0, m.queued_bytes)
                   for m in prefill],
        )
        family = card.family if card.shares_prefill and prefix else None
        decision = place(RequestSnapshot(next(self._requests), card.name, family, max(1, len(prefix))),
                         snapshot, self.config.policy, name=self.config.placement_policy)
        self.stats.decisions[decision.prefill.reason.value] += 1
        member = next(m for m in candidates if m.id == decision.decode.worker_id)
        reason = decision.prefill.reason.value
        if decision.prefill.where is not Where.REMOTE:
            return member, None, _Route(reason, "local", time.monotonic() - started)
        assert decision.prefill.prefill_worker is not None
        source = next(m for m in prefill if m.id == decision.prefill.prefill_worker.id)
        task = await self._offload(request_id, member, source, prefix, salt, lossy, decision)
        return member, lossy, _Route(reason, source.url, time.monotonic() - started, task, self.config.codec)

    async def _offload(
        self, request_id: str, dest: Member, source: Member, prefix: list[int], salt: str, lossy: str | None,
        decision: RouteDecision,
    ) -> asyncio.Task[Prefilled | None] | None:
        """Have ``dest`` expect the prefix blocks it lacks and ``source`` compute and send them
        (the transfer's task; None: ``dest`` lacks none)."""
        tid = f"{request_id}/kv-{uuid.uuid4().hex[:8]}"
        timeout = self.config.transfer_timeout
        assert dest.info is not None
        depths = dest.info.hidden_depths if self._sends_hidden(source, dest, lossy) else []
        expected = Expected.model_validate(await self._post(dest, "/internal/kv/expect", Expect(
            transfer_id=tid, token_ids=prefix, salt=salt, prefix_codec=lossy, timeout=timeout, hidden=bool(depths))))
        if expected.num_blocks == 0:
            return None
        order = Prefill(transfer_id=tid, token_ids=prefix[: (expected.first_block + expected.num_blocks) * self.facts.block_size],
                        salt=salt, first_block=expected.first_block,
                        destination=expected.address[self._transport_between(source, dest)],
                        codec=self.config.codec, hidden_depths=depths)
        nbytes = expected.num_blocks * self.facts.block_size * self._kv_bytes_per_token()
        task = asyncio.create_task(tracing.traced(
            "transfer", self._run_transfer(source, dest, order, decision.prefill.compute_tokens, nbytes),
            transfer_id=tid, prefill_worker=source.url, decode_worker=dest.url, blocks=expected.num_blocks))
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)
        return task

    async def _run_transfer(
        self, source: Member, dest: Member, order: Prefill, tokens: int, nbytes: int
    ) -> Prefilled | None:
        """Order the transfer; its figures, or None if it failed (``dest`` computes the rest)."""
        source.queued_tokens += tokens
        source.queued_bytes += nbytes
        try:
            done = Prefilled.model_validate(await self._post(source, "/internal/prefill", order,
                                                             timeout=self.config.transfer_timeout))
            if done.link_seconds > 0 and done.bytes:  # the link's own time, not the prefill's
                rate = done.bytes / done.link_seconds
                source.link_bytes_s = rate if source.link_bytes_s is None else 0.8 * source.link_bytes_s + 0.2 * rate
            return done
        except Exception as exc:  # the decode side recomputes what did not arrive; say so, and tell it now
            self.stats.transfer_failures += 1
            if isinstance(exc, WorkerDown):
                self._down(source, exc)
            log.warning("transfer failed; the decode worker prefills locally",
                        extra={"event": "transfer_failed", "transfer": order.transfer_id, "error": str(exc)})
            try:
                await self._post(dest, "/internal/kv/abort", TransferRef(transfer_id=order.transfer_id, reason=str(exc)))
            except Exception:
                pass  # it times the expectation out by itself
            return None
        finally:
            source.queued_tokens -= tokens
            source.queued_bytes -= nbytes

    @staticmethod
    def _sends_hidden(source: Member, dest: Member, lossy: str | None) -> bool:
        """Whether blocks ``source`` sends to ``dest`` can bring the hidden state of every layer
        ``dest`` keeps (its layer-split agents then fill from them): ``source`` keeps those
        layers too, and the codec is exact (a lossy codec's blocks fill nobody)."""
        return (lossy is None and source.info is not None and dest.info is not None
                and set(dest.info.hidden_depths) <= set(source.info.hidden_depths))

    def _transport_between(self, source: Member, dest: Member) -> str:
        if self.config.transport != "auto":
            return self.config.transport
        return "shm" if urlsplit(source.url).hostname == urlsplit(dest.url).hostname else "tcp"

    def _snap(self, m: Member, role: Role, cached: Cached) -> WorkerSnapshot:
        return WorkerSnapshot(m.id, role, self.facts.family, cached_tokens=cached.cached_tokens,
                              queue_depth=cached.waiting, queued_tokens=m.queued_tokens, running=cached.running,
                              occupancy=min(1.0, cached.occupancy), prefill_tok_s=self._prefill_rate(m))

    def _prefill_rate(self, m: Member) -> float:
        """The worker's measured prefill throughput; before it measured any, the configured one."""
        measured = m.stats.prefill_tok_s if m.stats is not None else 0.0
        return measured if measured > 0 else self.config.prefill_tok_s

    def _lossy_codec(self) -> str | None:
        """The lossy namespace moved blocks land in, or None when the codec is exact for our KV."""
        return self.config.codec if is_lossy(self.config.codec, getattr(torch, self._kv_dtype())) else None

    def _kv_dtype(self) -> str:
        infos = [m.info for m in self.members if m.info is not None]
        return infos[0].kv_dtype if infos else "float32"

    def _kv_bytes_per_token(self) -> int:
        infos = [m.info for m in self.members if m.info is not None]
        return infos[0].kv_bytes_per_token if infos else 1

    # ---- talking to workers --------------------------------------------------------------------

    async def _generate(
        self, member: Member, request_id: str, module: str, prompt: Prompt, params: SamplingParams, salt: str,
        prefix_codec: str | None,
    ) -> httpx.Response:
        assert self._client is not None
        body = Generate(request_id=request_id, module=module, prompt=PromptFields.of(prompt),
                        params=SamplingFields.of(params), salt=salt, prefix_codec=prefix_codec)
        request = self._client.build_request("POST", f"{member.url}/internal/generate", json=body.model_dump(),
                                             timeout=httpx.Timeout(None, connect=2.0), headers=tracing.headers())
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise WorkerDown(f"{member.url}: {exc}") from exc
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            error = _remote(response)
            if str(error).startswith("Unavailable:"):  # its engine is stuck or stopped: another worker
                raise WorkerDown(f"{member.url}: {error}")
            raise error
        return response

    async def _lookup(self, member: Member, prefix: list[int], salt: str) -> Cached:
        if not prefix:
            s = member.stats
            return Cached(cached_tokens=0, waiting=s.waiting if s else 0, running=s.running if s else 0)
        try:
            return Cached.model_validate(await self._post(member, "/internal/lookup", Lookup(token_ids=prefix, salt=salt)))
        except WorkerDown as exc:
            self._down(member, exc)
            return Cached(cached_tokens=0, waiting=1 << 20)  # placed last; the next attempt skips it

    async def _post(self, member: Member, path: str, body: Any, *, timeout: float | None = 30.0) -> Any:
        assert self._client is not None
        try:
            r = await self._client.post(f"{member.url}{path}", json=body.model_dump(), timeout=timeout,
                                        headers=tracing.headers())
        except httpx.TransportError as exc:
            raise WorkerDown(f"{member.url}: {exc}") from exc
        if r.status_code >= 400:
            raise _remote(r)
        return r.json() if r.content else None

    async def _stats(self, member: Member) -> WorkerStats:
        assert self._client is not None
        try:
            r = await self._client.get(f"{member.url}/internal/stats", timeout=2.0)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise WorkerDown(f"{member.url}: {exc}") from exc
        return WorkerStats.model_validate(r.json())

    # ---- membership ----------------------------------------------------------------------------

    def _alive(self, role: str | None = None) -> list[Member]:
        return [m for m in self.members if m.alive and (role is None or m.role == role)]

    def _down(self, member: Member, exc: BaseException) -> None:
        if member.alive:
            member.alive = False
            self.stats.workers_down += 1
            log.warning("worker down", extra={"event": "worker_down", "worker": member.url, "error": str(exc)})

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(m) for m in list(self.members)))
            await asyncio.sleep(self.config.health_interval)

    async def _check(self, member: Member) -> None:
        try:
            member.stats = await self._stats(member)
        except WorkerDown as exc:
            self._down(member, exc)
            return
        if not member.alive:  # back (restarted, maybe with a new KV address): read it again
            try:
                await self._admit(member)
            except (WorkerDown, InvalidRequest) as exc:
                log.warning("worker refused", extra={"event": "worker_refused", "worker": member.url, "error": str(exc)})
                return
            self.stats.rejoined += 1
            log.info("worker rejoined", extra={"event": "worker_rejoined", "worker": member.url})

    async def _admit(self, member: Member) -> None:
        assert self._client is not None
        try:
            info = WorkerInfo.model_validate((await self._client.get(f"{member.url}/internal/info", timeout=5.0)).json())
        except httpx.HTTPError as exc:
            raise WorkerDown(f"{member.url}: {exc}") from exc
        check_worker(info, self.facts)
        member.info, member.alive = info, True

    async def join(self, url: str) -> WorkerInfo:
        """Add a worker by URL (a worker on another host); idempotent."""
        member = next((m for m in self.members if m.url == url), None)
        if member is None:
            member = Member(next(self._ids), url)
            await self._admit(member)
            self.members.append(member)
            log.info("worker joined", extra={"event": "worker_joined", "worker": url, "role": member.role})
        elif not member.alive:
            await self._admit(member)
        assert member.info is not None
        return member.info

    def _member_only(self, request: Request) -> None:
        if not self.secret.check(request.headers.get(HEADER)):
            log.warning("join refused", extra={"event": "join_refused", "peer": request.client.host if request.client else ""})
            raise ApiError(401, f"joining needs the cluster secret: send its token in {HEADER} (start the worker "
                           "with --cluster-secret-file)", type="authentication_error", code="invalid_cluster_secret")

    def _admin_only(self, request: Request) -> None:
        if (why := check_admin(self.admin_key, request.headers.get("authorization"))) is not None:
            raise ApiError(401, why, type="authentication_error", code="invalid_admin_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def _routes(self) -> APIRouter:
        r = APIRouter(prefix="/internal", include_in_schema=False)

        @r.post("/workers", dependencies=[Depends(self._member_only)])
        async def join(body: Join) -> Any:
            try:
                return await self.join(body.url.rstrip("/"))
            except WorkerDown as exc:
                return JSONResponse({"kind": "WorkerDown", "message": str(exc)}, status_code=502)
            except InvalidRequest as exc:
                return JSONResponse({"kind": "InvalidRequest", "message": str(exc)}, status_code=409)

        @r.get("/cluster", dependencies=[Depends(self._admin_only)])
        async def cluster() -> dict[str, Any]:
            stats = await asyncio.gather(*(self._stats(m) for m in self.members), return_exceptions=True)
            return {
                "workers": [
                    {"url": m.url, "role": m.role, "alive": m.alive,
                     "agents": [a.name for a in m.info.agents] if m.info else [],
                     "stats": s.model_dump() if isinstance(s, WorkerStats) else None}
                    for m, s in zip(self.members, stats, strict=True)
                ],
                "decisions": dict(self.stats.decisions), "retries": self.stats.retries,
                "transfer_failures": self.stats.transfer_failures, "workers_down": self.stats.workers_down,
                "rejoined": self.stats.rejoined,
            }

        return r


def _remote(response: httpx.Response) -> Exception:
    try:
        return RemoteError.model_validate(response.json()).exception()
    except ValueError:
        return RemoteError(kind="WorkerError", message=f"HTTP {response.status_code}: {response.text[:200]}").exception()
