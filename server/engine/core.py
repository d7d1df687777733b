"""The engine core: admission, continuous batching and sampling over one shared KV pool.

Synchronous and loop-free: ``add_request`` queues, ``step`` runs one forward step of every
running request and returns their new tokens. ``AsyncEngine`` drives it from a thread.

One step::

    admit waiting requests (FIFO) while the pool can reserve prompt + max_tokens for them:
        match the prompt's cached chain (shared blocks of the family, the module's own blocks)
        register the blocks it will compute, so later arrivals wait for them (one prefill)
    schedule: one token per decoding request, then prefill chunks within max_step_tokens
    run: one forward for the base and every LoRA module (per-row deltas from the IP on),
         one per full module (its rows at or after the IP); shared prefixes read once
    sample the requests whose prompt is done; stream tokens; finish on stop/length

Who computes a position is decided here, once (DESIGN §2): positions < IP by the base,
positions >= IP by the module; a module without a family manifest has IP 0 (private prefill).

Failures stay with their request: a request that raises while being admitted, in the forward
(the step is re-run one request at a time to find which), in the logits hook, the sampler or
the detokenizer ends alone with ``FinishReason.ERROR`` and a message, its KV freed; the rest
of the step goes on.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from server.engine.batch import Chunk, SharedPrefix, plan_step
from server.engine.detokenize import Decoder, TextStream
from server.engine.errors import InvalidRequest, Overloaded, PromptTooLong, UnknownModule
from server.engine.forward import LlamaForward
from server.engine.projection import LowRank, Projection, RowDeltaProjection
from server.engine.sampling import Sampled, SamplingParams, sample
from server.engine.sequence import FinishReason, Phase, Sequence, TokenEvent
from server.kv.keys import Layout, Namespace
from server.kv.pool import BlockPool, BlockState, Pin, PrefixMatch
from server.kv.storage import KVStorage
from server.modules.manifest import ModuleKind
from server.modules.registry import DecodeModule
from server.prompt import Prompt

log = logging.getLogger("agentshare.engine")
WorkItem = tuple[Sequence, int, int]  # a request, its first position in this step, how many


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Engine knobs. ``share_prefill=False`` keys every cache by module, as engines do today
    (the baseline arm of the benchmarks)."""

    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    max_step_tokens: int = 512
    max_running: int = 64
    max_waiting: int = 1024
    share_prefill: bool = True
    step_timeout: float = 60.0
    """Seconds one step may run before the watchdog of :class:`AsyncEngine` fails its requests
    and reports the engine degraded (vLLM's iteration timeout is 60 s too)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_step_tokens <= 0 or self.max_running <= 0:
            raise ValueError("block_size, max_step_tokens and max_running must be positive")
        if not self.step_timeout > 0:
            raise ValueError(f"step_timeout must be a positive number of seconds, got {self.step_timeout}")


@dataclass(slots=True)
class EngineStats:
    """Counters since start; tokens, not blocks."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # not computed by their request: shared, cached or in flight
    prefill_tokens: int = 0  # prompt positions computed
    base_rows: int = 0  # positions computed with the base weights (prefill and decode)
    module_rows: int = 0  # positions computed with a module's weights (LoRA or full)
    decode_tokens: int = 0
    steps: int = 0
    finished: int = 0
    replans: int = 0  # requests that re-planned after a block they awaited was abandoned
    prefill_tok_s: float = 0.0  # measured: EWMA over steps that were mostly prefill (0: none yet)

    def observe_step(self, rows: int, prefill_rows: int, seconds: float) -> None:
        """Fold one step into the prefill-throughput estimate (placement policies read it)."""
        if prefill_rows >= 32 and prefill_rows >= rows // 2 and seconds > 0:
            rate = rows / seconds
            self.prefill_tok_s = rate if not self.prefill_tok_s else 0.7 * self.prefill_tok_s + 0.3 * rate


class EngineCore:
    """Serve requests for any decode module of one family from one KV pool."""

    def __init__(
        self,
        forward: LlamaForward,
        tokenizer: Decoder,
        *,
        family: str,
        modules: Mapping[str, DecodeModule],
        eos_token_ids: tuple[int, ...] = (),
        config: EngineConfig = EngineConfig(),
        logits_hook: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        """``logits_hook(request_id, logits)`` sees every row of logits a request samples from
        (evaluation and tests; off the hot path when None)."""
        self.forward, self.tokenizer, self.family, self.config = forward, tokenizer, family, config
        self.logits_hook = logits_hook
        self.modules = dict(modules)
        self._base_name = next((n for n, m in self.modules.items() if m.is_base), "")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVStorage.from_budget(
            forward.kv_spec(), budget_bytes=config.kv_cache_bytes, block_size=config.block_size
        )
        self.pool = BlockPool(self.kv.num_blocks, config.block_size, bytes_per_block=self.kv.bytes_per_block)
        self.max_context = forward.weights.shape.max_context
        self.stats = EngineStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.contexts: dict[str, Pin] = {}  # pinned shared contexts by id
        self._lora_index: dict[str, int] = {}
        self._deltas: dict[tuple[int, int, str], list[LowRank]] = {}
        self._full: dict[str, LlamaForward] = {}
        for name, m in self.modules.items():
            if m.kind is ModuleKind.LORA:
                idx = self._lora_index.setdefault(name, len(self._lora_index))
                for (layer, proj), updates in m.deltas.items():
                    self._deltas[(idx, layer, proj)] = updates
            elif m.kind is ModuleKind.FULL:
                assert m.weights is not None
                self._full[name] = LlamaForward(m.weights, forward.rope)

    @property
    def base_name(self) -> str:
        """The name the base model is served under (it computes every shared prefix)."""
        return self._base_name

    def with_config(self, config: EngineConfig) -> EngineCore:
        """A new engine on the same model and modules, with its own empty KV pool."""
        return EngineCore(
            self.forward, self.tokenizer, family=self.family, modules=self.modules,
            eos_token_ids=tuple(sorted(self.eos_token_ids)), config=config, logits_hook=self.logits_hook,
        )

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self, request_id: str, module: str, prompt: Prompt, params: SamplingParams, *, salt: str = "",
        prefix_codec: str | None = None,
    ) -> Sequence:
        """Queue a request. Raises a typed error for anything that could never be served.

        ``prefix_codec`` names the lossy codec (e.g. ``"int8"``) its shared prefix crossed on the
        way here: the request then reads (and writes) the family's blocks in that codec's lossy
        namespace, never the exact ones (DESIGN §2)."""
        m = self.modules.get(module)
        if m is None:
            raise UnknownModule(module, list(self.modules))
        n = len(prompt.token_ids)
        if n + 1 > self.max_context:
            raise PromptTooLong(n + 1, self.max_context)
        if any(not 0 <= t < self.forward.weights.shape.vocab_size for t in prompt.token_ids):
            raise InvalidRequest("the prompt holds token ids outside the model's vocabulary")
        capacity = min(n + params.max_tokens, self.max_context)
        if math.ceil(capacity / self.config.block_size) > self.pool.capacity:
            raise PromptTooLong(capacity, self.pool.capacity * self.config.block_size, what="the whole KV pool")
        if len(self.waiting) >= self.config.max_waiting:
            raise Overloaded(f"{len(self.waiting)} requests are already waiting; retry later")
        ip, layout = self._layout(m, prompt, salt, prefix_codec)
        self._refuse_if_pins_block(prompt, layout, capacity)
        seq = Sequence(
            request_id, m, self._lora_index.get(module, -1), prompt, ip, params, layout,
            TextStream(self.tokenizer, params.stop), None if params.greedy else params.generator(),
            capacity,
        )
        self.waiting.append(seq)
        self.stats.prompt_tokens += n
        return seq

    def _refuse_if_pins_block(self, prompt: Prompt, layout: Layout, capacity: int) -> None:
        """Refuse now (with the time until the first pin ends) a request that could only be
        admitted once pinned contexts expire, rather than let it wait in the queue that long."""
        pinned = self.pool.pinned_blocks()
        if not pinned:
            return
        usable = set(self.pool.match(list(prompt.token_ids), layout).block_ids)
        need = math.ceil(capacity / self.config.block_size) - len(usable)
        if need > self.pool.capacity - len(pinned - usable):
            deadline = self.pool.next_pin_deadline()
            wait = max(0.0, (deadline or 0.0) - self.pool.clock())
            raise Overloaded("pinned contexts fill the KV pool; release a context or retry after its TTL",
                             retry_after=wait, reason="kv_pool_pinned")

    def _layout(
        self, m: DecodeModule, prompt: Prompt, salt: str, prefix_codec: str | None = None
    ) -> tuple[int, Layout]:
        """The invocation point and block namespaces of a request: DESIGN §2 in one place."""
        n = len(prompt.token_ids)
        if m.is_base:
            ip = n
        elif m.shares_prefill:
            ip = prompt.invocation_point(m.placement)
        else:
            ip = 0  # private prefill: the module computes everything itself
        fam = self.family if self.config.share_prefill else f"{self.family}/{m.name}"
        family_ns = Namespace.family(fam, salt=salt)
        if prefix_codec is not None and ip > 0:
            family_ns = family_ns.lossy(prefix_codec)
        if m.is_base:
            return ip, Layout(family_ns)
        return ip, Layout(family_ns, Namespace.module(m.digest, invocation_point=ip, salt=salt))

    def prefix_layout(self, *, salt: str = "", prefix_codec: str | None = None) -> Layout:
        """The layout of the family's shared blocks (positions before any module's IP): what a
        prefill worker computes and a decode worker imports for every module of the family."""
        return self._layout(self.modules[self._base_name], Prompt((0,), 1, 1, 1), salt, prefix_codec)[1]

    def explain(
        self, module: str, prompt: Prompt, *, salt: str = "", prefix_codec: str | None = None
    ) -> PrefixMatch:
        """What the cache holds for this request right now (a pure query): how many of its
        full blocks would hit, and the index of the first that would not."""
        m = self.modules.get(module)
        if m is None:
            raise UnknownModule(module, list(self.modules))
        _, layout = self._layout(m, prompt, salt, prefix_codec)
        return self.pool.match(list(prompt.token_ids), layout)

    def add_context(
        self, context_id: str, token_ids: SequenceOf[int], *, ttl: float, salt: str = "", module: str | None = None
    ) -> Sequence:
        """Prefill a shared context with the base and pin its full blocks for ``ttl`` seconds.

        Ends with a ``PREFILLED`` event; the pin is then in ``contexts[context_id]`` until
        :meth:`release_context` or expiry. Requests whose prompt starts with these tokens (any
        module of the family, same salt) read the pinned blocks instead of recomputing them.
        """
        if ttl <= 0:
            raise InvalidRequest("a context's ttl must be positive")
        if context_id in self.contexts and self.pool.is_pinned(self.contexts[context_id]):
            raise InvalidRequest(f"context {context_id!r} already exists")
        n = len(token_ids)
        prompt = Prompt(tuple(token_ids), n, n, n)
        seq = self.add_request(context_id, module or self._base_name, prompt, SamplingParams(max_tokens=1), salt=salt)
        seq.capacity, seq.pin_ttl = n, ttl
        return seq

    def release_context(self, context_id: str) -> bool:
        """Unpin a context; False if it is unknown or already expired."""
        pin = self.contexts.pop(context_id, None)
        return pin is not None and self.pool.unpin(pin)

    def cancel(self, request_id: str) -> TokenEvent | None:
        """Stop a request wherever it is and free its KV. None if it is not (or no longer) here."""
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                return self._finish(seq, FinishReason.CANCELLED)
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------

    def expire(self) -> int:
        """Release pins whose TTL has passed (and forget their contexts); returns how many."""
        n = self.pool.expire_pins()
        if n:
            self.contexts = {k: p for k, p in self.contexts.items() if self.pool.is_pinned(p)}
        return n

    def step(self) -> list[TokenEvent]:
        self.expire()
        events = self._admit()
        self._resolve_pending()
        for seq in [s for s in self.running if s.pin_ttl is not None and not s.pending
                    and s.num_computed == len(s.tokens)]:
            events.append(self._alone(seq, self._pin_context))  # found whole in the cache: nothing to compute
        work = self._schedule()
        if not work:
            return events
        self.stats.steps += 1
        started = time.perf_counter()
        done, failed = self._forward(work)
        events += [self._fail(seq, exc) for seq, exc in failed]
        self.stats.observe_step(sum(n for _, _, n in work),
                                sum(n for seq, _, n in work if seq.phase is Phase.PREFILL),
                                time.perf_counter() - started)
        sampled_seqs, rows = [], []
        for (seq, start, n), row in done:
            try:
                seq.num_computed = start + n
                self._commit_blocks(seq)
                if seq.num_computed == len(seq.tokens) and seq.pin_ttl is not None:
                    events.append(self._pin_context(seq))
                elif seq.num_computed == len(seq.tokens):  # prompt done, or a decode step
                    if self.logits_hook is not None:
                        self.logits_hook(seq.request_id, row)
                    sampled_seqs.append(seq)
                    rows.append(row)
            except Exception as exc:
                events.append(self._fail(seq, exc))
        for seq, out in zip(sampled_seqs, self._sample(sampled_seqs, rows), strict=True):
            if isinstance(out, Exception):
                events.append(self._fail(seq, out))
            else:
                events.append(self._alone(seq, lambda s, o=out: self._emit(s, o.token_id, o.logprob, o.top_logprobs)))
        return events

    def _forward(self, work: list[WorkItem]) -> tuple[list[tuple[WorkItem, torch.Tensor]], list[tuple[Sequence, Exception]]]:
        """Run the step; if it raises, run each request alone (rewriting only its own, not yet
        committed, positions) so that only the ones that fail by themselves fail."""
        try:
            return list(zip(work, self._run(work), strict=True)), []
        except Exception as exc:
            if len(work) == 1:
                return [], [(work[0][0], exc)]
        done: list[tuple[WorkItem, torch.Tensor]] = []
        failed: list[tuple[Sequence, Exception]] = []
        for item in work:
            try:
                done.append((item, self._run([item])[0]))
            except Exception as exc:
                failed.append((item[0], exc))
        return done, failed

    def _sample(self, seqs: list[Sequence], rows: list[torch.Tensor]) -> list[Sampled | Exception]:
        """One row at a time, so a row that raises fails its request only (each request draws from
        its own generator: the batch never changed its tokens anyway)."""
        outs: list[Sampled | Exception] = []
        for seq, row in zip(seqs, rows, strict=True):
            try:
                outs.append(sample(row[None], [seq.params], [seq.generator], [_forced(seq)])[0])
            except Exception as exc:
                outs.append(exc)
        return outs

    def _alone(self, seq: Sequence, fn: Callable[[Sequence], TokenEvent]) -> TokenEvent:
        try:
            return fn(seq)
        except Exception as exc:
            return self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: BaseException | str) -> TokenEvent:
        """End one request that raised inside the step (or ``exc``: why), with its error; the
        others go on."""
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        log.error("a request failed inside the engine", exc_info=None if isinstance(exc, str) else exc,
                  extra={"event": "request_failed", "request": seq.request_id, "error": error})
        if seq.phase is Phase.WAITING and seq.blocks:  # it failed half-way through admission
            self._drop_blocks(seq)
        try:
            return self._finish(seq, FinishReason.ERROR, error=error)
        except Exception:  # its books are broken: forget it anyway, never fail the others
            log.exception("could not free a failed request", extra={"event": "request_leaked", "request": seq.request_id})
            for queue in (self.waiting, self.running):
                if seq in queue:
                    queue.remove(seq)
            seq.phase, seq.finish_reason = Phase.FINISHED, FinishReason.ERROR
            return TokenEvent(seq.request_id, None, "", finish_reason=FinishReason.ERROR, error=error)

    def fail_all(self, error: str) -> list[TokenEvent]:
        """End every request with ``error`` (the step itself broke: nothing tells whose fault)."""
        return [self._fail(seq, error) for seq in [*self.waiting, *self.running]]

    def _admit(self) -> list[TokenEvent]:
        failed: list[TokenEvent] = []
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            try:
                if not self._reserve(seq):
                    break  # FIFO: wait for memory to free up
            except Exception as exc:
                failed.append(self._fail(seq, exc))
                continue
            self.waiting.popleft()
            self.running.append(seq)
        return failed

    def _reserve(self, seq: Sequence) -> bool:
        prompt, bs = list(seq.prompt.token_ids), self.config.block_size
        match = self.pool.match(prompt, seq.layout)
        if match.num_cached_tokens >= len(prompt) and seq.pin_ttl is None:  # sample from a computed row
            ids = match.block_ids[:-1]
            match = PrefixMatch(match.keys, ids, tuple(b for b in match.pending if b in ids), bs)
        need = math.ceil(seq.capacity / bs) - len(match.block_ids)
        if not self.pool.can_allocate(need):
            return False
        self.pool.acquire(match, reader=seq.module.name)
        fresh = self.pool.allocate(need, contiguous=True)
        self.pool.register(match, fresh, prompt, seq.layout, computed_by=seq.module.name)
        seq.blocks = [*match.block_ids, *fresh]
        seq.slot_table = self.kv.slots(seq.blocks)[: seq.capacity]
        limit, run = min(seq.prompt.context_len // bs, len(seq.blocks)), 0
        while run < limit and (run == 0 or seq.blocks[run] == seq.blocks[run - 1] + 1):
            run += 1
        seq.prefix_blocks = run
        seq.match, seq.pending = match, match.pending
        seq.num_computed = seq.cached_tokens = match.num_cached_tokens
        seq.num_committed_blocks = len(match.block_ids)
        seq.phase = Phase.PREFILL
        self.stats.cached_prompt_tokens += seq.cached_tokens
        return True

    def _resolve_pending(self) -> None:
        for seq in [s for s in self.running if s.pending]:
            states = {self.pool.block(b).state for b in seq.pending}
            if states <= {BlockState.READY}:
                seq.pending = ()
            elif not states <= {BlockState.READY, BlockState.COMPUTING}:
                self._replan(seq)  # its producer gave up: start over from a fresh match

    def _replan(self, seq: Sequence) -> None:
        self._drop_blocks(seq)
        self.running.remove(seq)
        self.stats.cached_prompt_tokens -= seq.cached_tokens
        seq.phase, seq.pending, seq.num_computed, seq.cached_tokens = Phase.WAITING, (), 0, 0
        self.waiting.appendleft(seq)
        self.stats.replans += 1

    def _schedule(self) -> list[WorkItem]:
        work: list[WorkItem] = []
        budget = self.config.max_step_tokens
        for seq in self.running:
            if seq.phase is Phase.DECODE:
                work.append((seq, len(seq.tokens) - 1, 1))
                budget -= 1
        for seq in self.running:
            if seq.phase is not Phase.PREFILL or seq.pending or budget <= 0:
                continue
            start = seq.num_computed
            n = min(budget, seq.prompt_len - start)
            if seq.module.kind is ModuleKind.FULL and start < seq.invocation_point:
                n = min(n, seq.invocation_point - start)  # base rows and module rows run apart
            work.append((seq, start, n))
            budget -= n
        return work

    def _run(self, work: list[WorkItem]) -> list[torch.Tensor]:
        """Logits of the last row of each work item, in order."""
        calls: dict[str | None, list[int]] = {}
        for i, (seq, start, _) in enumerate(work):
            full = seq.module.kind is ModuleKind.FULL and start >= seq.invocation_point
            calls.setdefault(seq.module.name if full else None, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(work)
        for name, idx in calls.items():
            items = [work[i] for i in idx]
            plan = plan_step([self._chunk(*it) for it in items], block_size=self.config.block_size)
            fwd = self.forward if name is None else self._full[name]
            logits = fwd(plan, self.kv, projection=self._projection(items) if name is None else None)
            for i, row in zip(idx, logits, strict=True):
                out[i] = row
            self._count_rows(items, base_call=name is None)
        return out  # type: ignore[return-value]

    def _chunk(self, seq: Sequence, start: int, n: int) -> Chunk:
        bs = self.config.block_size
        # The shared prefix: leading consecutive blocks of the shared context, already written.
        # Every agent of one context gets the same one, so the batch reads it once.
        run = min(seq.prefix_blocks, start // bs)
        prefix = SharedPrefix(seq.blocks[0], run * bs) if run else None
        assert seq.slot_table is not None
        return Chunk(seq.tokens[start : start + n], start, seq.slot_table[run * bs : start + n], prefix)

    def _projection(self, items: list[tuple[Sequence, int, int]]) -> Projection | None:
        if not any(seq.module_index >= 0 for seq, _, _ in items):
            return None
        rows = []
        for seq, start, n in items:
            pos = torch.arange(start, start + n)
            rows.append(torch.where(pos >= seq.invocation_point, seq.module_index, -1) if seq.module_index >= 0
                        else torch.full((n,), -1))
        return RowDeltaProjection(torch.cat(rows), self._deltas)

    def _count_rows(self, items: list[tuple[Sequence, int, int]], *, base_call: bool) -> None:
        for seq, start, n in items:
            if not base_call:
                module = n  # a full module's own call
            elif seq.module_index >= 0:  # LoRA rows from the IP on
                module = max(0, start + n - max(start, seq.invocation_point))
            else:
                module = 0
            self.stats.module_rows += module
            self.stats.base_rows += n - module
            if seq.phase is Phase.PREFILL:
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n

    def _commit_blocks(self, seq: Sequence) -> None:
        full = min(seq.num_computed // self.config.block_size, len(seq.blocks))
        if full > seq.num_committed_blocks:
            self.pool.commit(seq.blocks[seq.num_committed_blocks : full])
            seq.num_committed_blocks = full

    # ---- output ----------------------------------------------------------------------------

    def _emit(self, seq: Sequence, token: int, logprob: float | None, top: list[tuple[int, float]]) -> TokenEvent:
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.phase = Phase.DECODE
        seq.tokens.append(token)
        p = seq.params
        reason = None
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            reason, text = FinishReason.STOP, seq.text.finish()
        else:
            text = seq.text.push(token)
            if seq.text.stopped:
                reason = FinishReason.STOP
            elif seq.num_generated >= p.max_tokens or len(seq.tokens) >= seq.capacity:
                reason, text = FinishReason.LENGTH, text + seq.text.finish()
        if reason is None:
            return TokenEvent(seq.request_id, token, text, logprob, top)
        end = self._finish(seq, reason)
        return TokenEvent(seq.request_id, token, text, logprob, top, reason, end.usage)

    def _pin_context(self, seq: Sequence) -> TokenEvent:
        assert seq.pin_ttl is not None
        full = seq.prompt_len // self.config.block_size
        self.contexts[seq.request_id] = self.pool.pin(seq.blocks[:full], ttl=seq.pin_ttl)
        return self._finish(seq, FinishReason.PREFILLED)

    def _finish(self, seq: Sequence, reason: FinishReason, *, error: str | None = None) -> TokenEvent:
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        elif seq.phase is not Phase.FINISHED:
            self._drop_blocks(seq)
            self.running.remove(seq)
        seq.phase, seq.finish_reason = Phase.FINISHED, reason
        self.stats.finished += 1
        return TokenEvent(seq.request_id, None, "", finish_reason=reason, usage=seq.usage(), error=error)

    def _drop_blocks(self, seq: Sequence) -> None:
        own = len(seq.match.block_ids) if seq.match else 0
        for bid in seq.blocks[max(own, seq.num_committed_blocks) :]:
            if self.pool.block(bid).state is BlockState.COMPUTING:
                self.pool.abort(bid)  # never computed: whoever waits for it must compute it
        self.pool.release(seq.blocks)
        seq.blocks, seq.match = [], None


def _forced(seq: Sequence) -> int | None:
    forced = seq.params.forced_tokens
    return forced[seq.num_generated] if seq.num_generated < len(forced) else None
