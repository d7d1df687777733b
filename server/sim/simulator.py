"""The discrete-event cluster simulator: requests in, vllm-bench-style metrics out, no model.

Per request the simulator does what the router will do: snapshot every worker (its cached
prefix of this request, queued prefill work, batch, occupancy) and every link, call
:func:`server.policy.place` (the placement policy ``ClusterConfig.placement_policy`` names), and
act on the answer::

    ARRIVE     match the request in every cache -> snapshots -> place()
               LOCAL : hold/register on the decode worker, queue a chunked local prefill
               REMOTE: hold/register on the prefill worker and the decode worker, book the
                       prefill (FCFS) and the link (FCFS, layer-pipelined)
    P_DONE     the remote prefill is computed: commit its blocks on the prefill worker
    XFER       the KV has arrived: commit on the decode worker; first token; join the batch
    ITER       a decode worker's iteration ended: prefills that completed emit their first token
               and join; requests with no token left finish

Events at one instant run in that order (commits, then arrivals, then iteration ends), so a
request arriving exactly at an iteration boundary is in the next iteration. Times are seconds.

>>> from server.sim.workload import SimRequest
>>> from server.sim.profile import CPU_SMOLLM2_135M
>>> sim = Simulator(ClusterConfig(prefill_profile=CPU_SMOLLM2_135M, block_tokens=32))
>>> res = sim.run([SimRequest(0, 0.0, input_tokens=320, output_tokens=1, blocks=tuple(range(10)))])
>>> res.records[0].ttft   # 320 tokens at 2,000 tok/s, locally (below the 1,024-token threshold)
0.16
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from server import positions
from server.kv.keys import Layout
from server.kv.pool import PrefixMatch
from server.policy import (
    ClusterSnapshot,
    LinkSnapshot,
    OffloadPolicy,
    RequestSnapshot,
    Role,
    Where,
    WorkerSnapshot,
    place,
)
from server.policy import placement as placements
from server.sim.cache import Holding, PrefixCache
from server.sim.metrics import RequestRecord, Summary, summarize
from server.sim.profile import CPU_SMOLLM2_135M, ServiceProfile
from server.sim.workers import DecodeWorker, Link, LocalPrefill, PrefillWorker
from server.sim.workload import SimRequest

P_DONE, XFER, ARRIVE, ITER = 0, 1, 2, 3  # priority of events at one instant


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """A simulated cluster. ``decode_profile`` defaults to ``prefill_profile``.

    ``cross_module_sharing=False`` keys every block by module (vLLM/SGLang today): agents of
    different modules never reuse each other's prefix. ``cache_tokens`` overrides the KV
    capacity of every worker (default: its profile's).
    """

    prefill_workers: int = 1
    decode_workers: int = 3
    prefill_profile: ServiceProfile = CPU_SMOLLM2_135M
    decode_profile: ServiceProfile | None = None
    link_bandwidth_bytes_s: float = 125e6
    link_latency_s: float = 0.0
    block_tokens: int = 32
    policy: OffloadPolicy = OffloadPolicy()
    placement_policy: str = placements.DEFAULT
    """The placement policy's registered name (:mod:`server.policy.placement`); ``policy`` holds
    the knobs it reads."""
    cross_module_sharing: bool = True
    cache_tokens: int | None = None
    family: str = "fam"

    @property
    def decode_prof(self) -> ServiceProfile:
        return self.decode_profile or self.prefill_profile


@dataclass(frozen=True, slots=True)
class SimResult:
    records: list[RequestRecord]
    summary: Summary
    wall_s: float
    evictions: int
    uncached_blocks: int
    unfinished: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


class Simulator:
    """One run of one cluster configuration (build a new one per run)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = c = config
        if c.decode_workers < 1 or c.prefill_workers < 0 or c.block_tokens < 1:
            raise ValueError("need >= 1 decode worker, >= 0 prefill workers, block_tokens >= 1")
        placements.get(c.placement_policy)  # an unknown name fails here

        def cache(p: ServiceProfile) -> PrefixCache:
            tokens = c.cache_tokens if c.cache_tokens is not None else p.capacity_tokens()
            return PrefixCache(max(1, tokens // c.block_tokens))

        pp, dp = c.prefill_profile, c.decode_prof
        self.prefill = [PrefillWorker(i, pp, cache(pp)) for i in range(c.prefill_workers)]
        self.links = [
            Link(c.link_bandwidth_bytes_s, c.link_latency_s, pp.layers)
            for _ in range(c.prefill_workers)
        ]
        self.decode = [DecodeWorker(i, dp, cache(dp)) for i in range(c.decode_workers)]
        self._events: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._records: dict[int, RequestRecord] = {}
        self._requests: dict[int, SimRequest] = {}
        self._hold_d: dict[int, Holding] = {}
        self._hold_p: dict[int, tuple[int, Holding]] = {}
        self._layouts: dict[tuple[str | None, str, int | None], Layout] = {}

    # ---- the loop ------------------------------------------------------------------------------

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        t0 = time.perf_counter()
        for r in requests:
            if r.id in self._requests:
                raise ValueError(f"duplicate request id {r.id}")
            self._requests[r.id] = r
            self._push(r.arrival_s, ARRIVE, r.id, 0)
        while self._events:
            now, kind, _, a, b = heapq.heappop(self._events)
            if kind == ARRIVE:
                self._arrive(now, self._requests[a])
            elif kind == P_DONE:
                self.prefill[a].cache.commit(self._hold_p[b][1])
            elif kind == XFER:
                self._transfer_done(now, self.decode[a], b)
            elif b == self.decode[a].version:  # ITER, not superseded
                self._iteration_done(now, self.decode[a])
        records = [self._records[r.id] for r in requests]
        caches = [w.cache for w in self.prefill] + [w.cache for w in self.decode]
        summary = summarize(records)
        return SimResult(
            records,
            summary,
            time.perf_counter() - t0,
            sum(x.pool.stats.evictions for x in caches),
            sum(x.uncached_blocks for x in caches),
            sum(1 for r in records if r.finish is None),
            summary.reasons,
        )

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, a, b))

    def _poke(self, w: DecodeWorker, now: float) -> None:
        end = w.poke(now)
        if end is not None:
            self._push(end, ITER, w.id, w.version)

    # ---- events --------------------------------------------------------------------------------

    def _arrive(self, now: float, req: SimRequest) -> None:
        c = self.config
        layout = self._layout(req)
        keys = PrefixCache.keys(req.blocks, layout)
        foreign = req.family != c.family
        d_matches = [w.cache.match(req.blocks, layout, keys) for w in self.decode]
        p_matches = [] if foreign else [w.cache.match(req.blocks, layout, keys) for w in self.prefill]
        snapshot = ClusterSnapshot(
            c.family,
            c.prefill_profile.kv_bytes_per_token,
            prefill=[
                WorkerSnapshot(
                    w.id, Role.PREFILL, c.family, self._tokens(m, req), w.queue_depth(now),
                    w.queued_tokens(now), 0, w.cache.occupancy(), w.profile.prefill_tok_s,
                )
                for w, m in zip(self.prefill, p_matches, strict=False)  # none for a foreign family
            ],
            decode=[
                WorkerSnapshot(
                    w.id, Role.DECODE, c.family, self._tokens(m, req), w.queue_depth(),
                    w.queued_tokens(), w.batch(), w.cache.occupancy(), w.effective_prefill_tok_s(),
                )
                for w, m in zip(self.decode, d_matches, strict=True)
            ],
            links=[
                LinkSnapshot(i, link.bandwidth_bytes_s, link.latency_s, link.queued_bytes(now))
                for i, link in enumerate(self.links)
            ],
        )
        placement = place(
            RequestSnapshot(req.id, req.module, req.family, req.input_tokens), snapshot, c.policy,
            name=c.placement_policy,
        )
        dec = placement.prefill
        assert placement.decode.worker is not None and dec.where is not Where.NOWHERE
        d = self.decode[placement.decode.worker.id]
        hold_d = d.cache.admit(req.id, d_matches[d.id], req.blocks, layout, module=req.module)
        self._hold_d[req.id] = hold_d
        rec = self._records[req.id] = RequestRecord(
            req.id, req.module, now, req.input_tokens, req.output_tokens, d.id,
            dec.where.value, dec.reason.value, dec.compute_tokens,
            req.input_tokens - dec.compute_tokens, blocks=len(req.blocks),
        )
        if dec.where is Where.LOCAL:
            rec.cross_module_tokens = min(hold_d.cross_module_blocks * c.block_tokens, rec.cached_tokens)
            rec.hit_blocks = len(d_matches[d.id].block_ids)
            d.enqueue_prefill(LocalPrefill(req.id, dec.compute_tokens, hold_d.deps, req.output_tokens))
            self._poke(d, now)
            return
        assert dec.prefill_worker is not None
        p = self.prefill[dec.prefill_worker.id]
        hold_p = p.cache.admit(req.id, p_matches[p.id], req.blocks, layout, module=req.module)
        self._hold_p[req.id] = (p.id, hold_p)
        rec.cross_module_tokens = min(hold_p.cross_module_blocks * c.block_tokens, rec.cached_tokens)
        rec.hit_blocks = len(p_matches[p.id].block_ids)
        rec.transfer_bytes = dec.transfer_bytes
        start, end = p.enqueue(now, dec.compute_tokens)
        arrival = self.links[p.id].reserve(start, end, dec.transfer_bytes)
        d.incoming += 1
        self._push(end, P_DONE, p.id, req.id)
        self._push(arrival, XFER, d.id, req.id)

    def _transfer_done(self, now: float, d: DecodeWorker, rid: int) -> None:
        d.incoming -= 1
        pid, hold_p = self._hold_p.pop(rid)
        self.prefill[pid].cache.release(hold_p)
        hold_d = self._hold_d[rid]
        d.cache.commit(hold_d)
        unparked = d.committed(rid)
        if d.kv_ready(rid, hold_d.deps, self._requests[rid].output_tokens - 1):
            self._first_token(now, d, rid)
        for u in unparked:
            self._first_token(now, d, u)
        self._poke(d, now)

    def _iteration_done(self, now: float, d: DecodeWorker) -> None:
        result = d.finish_iteration()
        for rid in result.finished:
            self._finish(now, d, rid)
        for p in result.prefilled:
            d.cache.commit(self._hold_d[p.request])
            unparked = d.committed(p.request)
            d.start_decode(p.request, p.output_tokens - 1)
            self._first_token(now, d, p.request)
            for u in unparked:
                self._first_token(now, d, u)
        self._poke(d, now)

    def _first_token(self, now: float, d: DecodeWorker, rid: int) -> None:
        rec = self._records[rid]
        rec.first_token = now
        if rec.output_tokens == 1:
            self._finish(now, d, rid)

    def _finish(self, now: float, d: DecodeWorker, rid: int) -> None:
        self._records[rid].finish = now
        d.cache.release(self._hold_d.pop(rid))

    # ---- helpers -------------------------------------------------------------------------------

    def _tokens(self, match: PrefixMatch, req: SimRequest) -> int:
        return min(len(match.block_ids) * self.config.block_tokens, req.input_tokens)

    def _layout(self, req: SimRequest) -> Layout:
        """The request's block namespaces by the engine's own rule (``server/positions.py``):
        module-keyed throughout when sharing is off, private for a foreign module."""
        key = (req.family, req.module, req.ip_blocks)
        layout = self._layouts.get(key)
        if layout is None:
            c = self.config
            ours = req.family == c.family
            facts = positions.Facts(req.module, req.module, is_base=ours and req.ip_blocks is None,
                                    shares_prefill=ours)
            ip = req.ip_blocks if ours and req.ip_blocks is not None else 0
            layout = positions.layout(facts, ip, family=c.family, share_prefill=c.cross_module_sharing)
            self._layouts[key] = layout
        return layout
