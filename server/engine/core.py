"""The engine core: one KV pool, one step loop over the scheduler, the runner and the output.

Synchronous and loop-free: ``add_request`` queues, ``step`` runs one forward step of every
running request and returns their new tokens. ``AsyncEngine`` drives it from a thread.

One step::

    scheduler.admit      waiting requests (FIFO) whose prompt + max_tokens fit the pool
    scheduler.schedule   one token per decoding request, then prefill chunks in budget
    runner.run           one forward for the base and every LoRA module, one per full module
    scheduler.computed   commit the blocks now written (later arrivals read them)
    output.sample/emit   the next token of every request whose prompt is done; stop rules

A constrained request (``SamplingParams.constraint``) has a grammar matcher from admission (a
bad schema, pattern or grammar is an ``InvalidRequest`` there). Its bitmask row is filled on a
worker thread while the forward runs; after it, every constrained row of the step is masked in
one op, the token is drawn from the masked row (logprobs from the raw one), and the matcher
consumes it (a forced token too: one the grammar refuses fails its request). A complete
grammar ends the request with ``STOP`` (``server/engine/constraints.py``).

Who computes a position, and under which keys, is ``server/positions.py``'s rule, applied
once per request at ``add_request``.

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
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from server import positions
from server.engine.config import EngineConfig, EngineStats
from server.engine.constraints import GrammarBackend, apply_masks
from server.engine.detokenize import Decoder, TextStream
from server.engine.device import kv_pool_bytes, step_workspace_bytes
from server.engine.errors import InvalidRequest, Overloaded, PromptTooLong, UnknownModule
from server.engine.forward import LlamaForward
from server.engine.graphs import DecodeGraphs, replay_tolerance
from server.engine.modules import DecodeModule
from server.engine.output import OutputProcessor
from server.engine.runner import ModelRunner
from server.engine.sampling import Sampled, SamplingParams
from server.engine.scheduler import Scheduler, WorkItem
from server.engine.sequence import FinishReason, Phase, Sequence, TokenEvent
from server.kv.keys import Layout
from server.kv.pool import BlockPool, Pin, PrefixMatch
from server.kv.storage import KVStorage
from server.prompt import Prompt

log = logging.getLogger("agentshare.engine")


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
        self.tokenizer, self.family, self.config = tokenizer, family, config
        self.modules = dict(modules)
        self._base_name = next((n for n, m in self.modules.items() if m.is_base), "")
        shape = forward.weights.shape
        self.split_layers = {n: positions.split_layer(m, shape.num_layers) for n, m in self.modules.items()}
        self.device = forward.weights.device
        self.kv = KVStorage.from_budget(
            forward.kv_spec(), budget_bytes=self._kv_budget(forward, config), block_size=config.block_size,
            hidden_depths=tuple(sorted({s for s in self.split_layers.values() if 0 < s < shape.num_layers}
                                       | set(config.keep_hidden))),  # a depth out of range: KVStorage refuses it
            hidden_width=shape.hidden_size, device=self.device,
        )
        self.pool = BlockPool(self.kv.num_blocks, config.block_size, bytes_per_block=self.kv.bytes_per_block)
        self.max_context = forward.weights.shape.max_context
        self.stats = EngineStats()
        self.contexts: dict[str, Pin] = {}  # pinned shared contexts by id
        self.scheduler = Scheduler(self.pool, self.kv, config, self.stats)
        self.runner = ModelRunner(forward, self.kv, self.modules, block_size=config.block_size, stats=self.stats)
        mode = config.decode_graphs
        if mode == "auto":
            mode = "cuda" if self.device.type == "cuda" else "off"
        if mode != "off":  # padding rows of a graph write one block that no request owns
            scratch = self.pool.allocate(1)[0] * config.block_size
            self.runner.graphs = DecodeGraphs(forward, self.kv, self.runner.lora, scratch_slot=scratch, mode=mode,
                                              tolerance=replay_tolerance(forward.weights.dtype))
        self.output = OutputProcessor(eos_token_ids, logits_hook)
        self._grammars: GrammarBackend | None = None
        self._masker: ThreadPoolExecutor | None = None  # fills constrained rows' masks during the forward

    @staticmethod
    def _kv_budget(forward: LlamaForward, config: EngineConfig) -> int:
        """The pool's bytes on the weights' device (``server/engine/device.py``)."""
        w = forward.weights
        return kv_pool_bytes(
            w.device, requested=config.kv_cache_bytes, utilization=config.memory_utilization,
            workspace=step_workspace_bytes(
                tokens=max(config.max_prefill_step_tokens + config.prefill_tail_tokens, config.max_step_tokens),
                rows=config.max_running + 1, hidden=w.shape.hidden_size,
                intermediate=w.layers[0].gate_up.weight.shape[0] // 2,
                qkv=w.shape.q_size + 2 * w.shape.kv_size, vocab=w.shape.vocab_size,
                itemsize=w.embed.element_size()))

    @property
    def forward(self) -> LlamaForward:
        """The base model's forward (the runner's; replace it to observe the base's calls)."""
        return self.runner.forward

    @forward.setter
    def forward(self, forward: LlamaForward) -> None:
        self.runner.forward = forward
        if self.runner.graphs is not None:  # graphs of the old forward replay the old one
            self.runner.graphs.reset(forward)

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.output.eos_token_ids

    @property
    def logits_hook(self) -> Callable[[str, torch.Tensor], None] | None:
        return self.output.logits_hook

    @logits_hook.setter
    def logits_hook(self, hook: Callable[[str, torch.Tensor], None] | None) -> None:
        self.output.logits_hook = hook

    @property
    def grammars(self) -> GrammarBackend:
        """The constraint backend over this engine's tokenizer and logits width (built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarBackend.for_tokenizer(self.tokenizer, self.forward.weights.shape.vocab_size,
                                                          tuple(sorted(self.eos_token_ids)))
        return self._grammars

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
        prefix_codec: str | None = None, exported: bool = False,
    ) -> Sequence:
        """Queue a request. Raises a typed error for anything that could never be served.

        ``exported``: a prefill run for a request another worker serves (a prefill worker's
        transfer job): its positions count under ``EngineStats.exported_*``, not as a request's.

        ``prefix_codec`` names the lossy codec (e.g. ``"int8"``) its shared prefix crossed on the
        way here: the request then reads (and writes) the family's blocks in that codec's lossy
        namespace, never the exact ones (docs/design.md §2)."""
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
        wait = self.scheduler.refuse_if_pins_block(prompt, layout, capacity)
        if wait is not None:
            raise Overloaded("pinned contexts fill the KV pool; release a context or retry after its TTL",
                             retry_after=wait, reason="kv_pool_pinned")
        matcher = None if params.constraint is None else self.grammars.matcher(params.constraint)
        seq = Sequence(
            request_id, m, self.runner.module_index.get(module, -1), prompt, ip, params, layout,
            TextStream(self.tokenizer, params.stop), None if params.greedy else params.generator(),
            capacity, exported=exported, matcher=matcher,
        )
        split = self.split_layers[module]
        seq.split_layer = split if split < self.forward.weights.shape.num_layers else None
        self.waiting.append(seq)
        if not exported:
            self.stats.prompt_tokens += n
        return seq

    def _layout(
        self, m: DecodeModule, prompt: Prompt, salt: str, prefix_codec: str | None = None
    ) -> tuple[int, Layout]:
        """The invocation point and block namespaces of a request (``server/positions.py``)."""
        ip = positions.invocation_point(prompt, m)
        return ip, positions.layout(m, ip, family=self.family, salt=salt, prefix_codec=prefix_codec,
                                    share_prefill=self.config.share_prefill)

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

    def explain_split(self, module: str, prompt: Prompt, *, salt: str = "") -> tuple[int, int]:
        """For a layer-split module: its recomputed layers, and how many of this prompt's prefix
        blocks past its own cached ones it would fill from the family's cache (their lower
        layers read, its top layers recomputed). ``(0, 0)`` for any other module."""
        m = self.modules.get(module)
        if m is None:
            raise UnknownModule(module, list(self.modules))
        split = self.split_layers[module]
        k = self.forward.weights.shape.num_layers - split
        if not k or split not in self.kv.hidden:
            return k, 0
        ip, layout = self._layout(m, prompt, salt)
        tokens = list(prompt.token_ids)
        first = len(self.pool.match(tokens, layout).block_ids)
        return k, max(0, self.scheduler.fillable(tokens, layout, first, ip)[1] - first)

    def add_context(
        self, context_id: str, token_ids: SequenceOf[int], *, ttl: float, salt: str = "", module: str | None = None,
        exported: bool = False,
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
        seq = self.add_request(context_id, module or self._base_name, prompt, SamplingParams(max_tokens=1), salt=salt,
                               exported=exported)
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
        return self.scheduler.has_work

    # ---- one step --------------------------------------------------------------------------

    def expire(self) -> int:
        """Release pins whose TTL has passed (and forget their contexts); returns how many."""
        n = self.pool.expire_pins()
        if n:
            self.contexts = {k: p for k, p in self.contexts.items() if self.pool.is_pinned(p)}
        return n

    def step(self) -> list[TokenEvent]:
        self.expire()
        events = self.scheduler.admit(self._fail)
        self.scheduler.resolve_pending()
        for seq in [s for s in self.running if s.pin_ttl is not None and not s.pending
                    and s.num_computed == len(s.tokens)]:
            events.append(self._pin_alone(seq))  # found whole in the cache: nothing to compute
        work = self.scheduler.schedule()
        if not work:
            return events
        self.stats.steps += 1
        started = time.perf_counter()
        masks = self._fill_masks(work)
        greedy = [seq.pin_ttl is None and start + n >= len(seq.tokens) and self.output.plain_greedy(seq)
                  for seq, start, n in work]  # they sample this step, from their row's argmax alone
        done, failed = self._forward(work, greedy)
        events += [self._fail(seq, exc) for seq, exc in failed]
        self.stats.observe_step(sum(n for _, _, n in work),
                                sum(n for seq, _, n in work if seq.phase is Phase.PREFILL),
                                time.perf_counter() - started)
        masked = self._apply_masks(masks, done)
        for (seq, start, n), row in done:
            event = self._alone(seq, partial(self._advance, upto=start + n, row=row, masked=masked.get(seq)))
            if event is not None:
                events.append(event)
        return events

    def _fill_masks(self, work: list[WorkItem]) -> Future[tuple[list[Sequence], torch.Tensor]] | None:
        """Start filling, on the mask thread, the bitmask rows of the constrained requests that
        sample this step (their prompt done by it, no forced token), while the forward runs."""
        seqs = [seq for seq, start, n in work if seq.matcher is not None and seq.pin_ttl is None
                and start + n >= len(seq.tokens) and seq.num_generated >= len(seq.params.forced_tokens)]
        if not seqs:
            return None
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="agentshare-masks")

        def fill() -> tuple[list[Sequence], torch.Tensor]:
            bitmask = torch.full((len(seqs), seqs[0].matcher.words), -1, dtype=torch.int32)  # type: ignore[union-attr]
            for i, seq in enumerate(seqs):
                seq.matcher.fill(bitmask, i)  # type: ignore[union-attr]
            return seqs, bitmask

        return self._masker.submit(fill)

    def _apply_masks(self, masks: Future[tuple[list[Sequence], torch.Tensor]] | None,
                     done: list[tuple[WorkItem, torch.Tensor | int]]) -> dict[Sequence, torch.Tensor]:
        """The masked rows of the constrained requests (one op for all); a request whose mask
        could not be computed fails alone when it samples (no masked row for it: see _advance)."""
        if masks is None:
            return {}
        try:
            seqs, bitmask = masks.result()
        except Exception as exc:
            log.error("constraint masks failed", exc_info=exc, extra={"event": "mask_failed"})
            return {}
        rows = {item[0]: row for item, row in done if isinstance(row, torch.Tensor)}  # a constrained row is never greedy-picked
        keep = [i for i, seq in enumerate(seqs) if seq in rows]
        if not keep:
            return {}
        raw = torch.stack([rows[seqs[i]].float() for i in keep])
        out = apply_masks(raw, bitmask[keep])
        return {seqs[i]: out[j] for j, i in enumerate(keep)}

    def _advance(self, seq: Sequence, upto: int, row: torch.Tensor | int,
                 masked: torch.Tensor | None = None) -> TokenEvent | None:
        """After the forward: commit what ``seq`` computed; pin a context whose prompt is done,
        or sample and emit the next token of a request whose prompt is (``row``: its logits, or
        its greedy token already chosen on the device)."""
        self.scheduler.computed(seq, upto)
        if seq.num_computed < len(seq.tokens):
            return None  # a prefill chunk: more of the prompt to come
        if seq.pin_ttl is not None:
            return self._pin_context(seq)
        seq.phase = Phase.DECODE
        if masked is None and seq.matcher is not None and seq.num_generated >= len(seq.params.forced_tokens):
            raise RuntimeError("its constraint's mask could not be computed this step")
        if isinstance(row, int):
            return self.output.emit(seq, Sampled(row), self._finish)
        return self.output.emit(seq, self.output.sample(seq, row, masked), self._finish)

    def _forward(self, work: list[WorkItem], greedy: list[bool]
                 ) -> tuple[list[tuple[WorkItem, torch.Tensor | int]], list[tuple[Sequence, Exception]]]:
        """Run the step; if it raises, run each request alone (rewriting only its own, not yet
        committed, positions) so that only the ones that fail by themselves fail."""
        try:
            return list(zip(work, self.runner.run(work, greedy), strict=True)), []
        except Exception as exc:
            if len(work) == 1:
                return [], [(work[0][0], exc)]
        done: list[tuple[WorkItem, torch.Tensor | int]] = []
        failed: list[tuple[Sequence, Exception]] = []
        for item, g in zip(work, greedy, strict=True):
            try:
                done.append((item, self.runner.run([item], [g])[0]))
            except Exception as exc:
                failed.append((item[0], exc))
        return done, failed

    def _alone(self, seq: Sequence, fn: Callable[[Sequence], TokenEvent | None]) -> TokenEvent | None:
        try:
            return fn(seq)
        except Exception as exc:
            return self._fail(seq, exc)

    def _pin_alone(self, seq: Sequence) -> TokenEvent:
        try:
            return self._pin_context(seq)
        except Exception as exc:
            return self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: BaseException | str) -> TokenEvent:
        """End one request that raised inside the step (or ``exc``: why), with its error; the
        others go on."""
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        log.error("a request failed inside the engine", exc_info=None if isinstance(exc, str) else exc,
                  extra={"event": "request_failed", "request": seq.request_id, "error": error})
        try:
            return self._finish(seq, FinishReason.ERROR, error=error)
        except Exception:  # its books are broken: forget it anyway, never fail the others
            log.exception("could not free a failed request", extra={"event": "request_leaked", "request": seq.request_id})
            self.scheduler.forget(seq)
            seq.phase, seq.finish_reason = Phase.FINISHED, FinishReason.ERROR
            return TokenEvent(seq.request_id, None, "", finish_reason=FinishReason.ERROR, error=error)

    def fail_all(self, error: str) -> list[TokenEvent]:
        """End every request with ``error`` (the step itself broke: nothing tells whose fault)."""
        return [self._fail(seq, error) for seq in [*self.waiting, *self.running]]

    # ---- the end ---------------------------------------------------------------------------

    def _pin_context(self, seq: Sequence) -> TokenEvent:
        assert seq.pin_ttl is not None
        full = seq.prompt_len // self.config.block_size
        self.contexts[seq.request_id] = self.pool.pin(seq.blocks[:full], ttl=seq.pin_ttl)
        return self._finish(seq, FinishReason.PREFILLED)

    def _finish(self, seq: Sequence, reason: FinishReason, *, error: str | None = None) -> TokenEvent:
        self.scheduler.remove(seq)
        seq.phase, seq.finish_reason = Phase.FINISHED, reason
        self.stats.finished += 1
        return TokenEvent(seq.request_id, None, "", finish_reason=reason, usage=seq.usage(), error=error,
                          timeline=seq.timeline(self.config.block_size))
