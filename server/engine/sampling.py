"""Sampling: from a step's logits to each request's next token, with its own random generator.

Each request owns a ``torch.Generator`` seeded from its seed (or from fresh entropy) and draws
exactly one sample per step from it, whatever else is in the batch: a seeded request gives the
same tokens alone and inside any batch (docs/design.md §4).

Per row, in order: penalties → temperature (0 = greedy) → top-k → top-p (nucleus) → sample.
The penalties (as vLLM applies them, before the greedy argmax too) need the row's tokens so far:

- ``repetition_penalty`` (HF/vLLM; 1 is off): the logit of every token that appears in the
  prompt or the output is divided by it where positive, multiplied by it where negative;
- ``frequency_penalty``, ``presence_penalty`` (OpenAI; 0 is off, range [-2, 2]), over the
  generated tokens only: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

Log-probabilities are those of the model's distribution (log-softmax of the raw logits), as vLLM
and OpenAI report them, for the chosen token and the ``logprobs`` most likely ones: at every
temperature and penalty, never those of the penalized, scaled or truncated distribution the
token was drawn from.

The sampler is total: every row gives a token, whatever its values and the parameters, and
never raises on them (a failed draw once took the whole engine down). The defined choices:

- a NaN logit is never chosen (it counts as ``-inf``);
- a ``+inf`` logit is a point mass: the first ``+inf`` token is chosen, greedy or sampled;
- top-p always keeps the most likely token (a ``top_p`` too small for float32, such as
  ``1e-300``, keeps that one alone);
- when no distribution is left to draw from (temperature scaling that overflows or underflows,
  every logit ``-inf`` or NaN, an empty top-p set), the choice is the argmax of the finite raw
  logits, which every filter keeps and the greedy limit picks; token 0 if none is finite;
- a log-probability that is not finite (an impossible token) is reported as
  :data:`LOGPROB_FLOOR` (JSON has no ``-inf``).

>>> nan, inf = float("nan"), float("inf")
>>> g = SamplingParams(seed=0).generator()
>>> [sample(torch.tensor([row]), [SamplingParams(temperature=t, top_p=tp)], [g])[0].token_id
...  for row, t, tp in [([nan, nan, 1.0], 1.0, 1.0), ([0.0, inf, 1.0], 1.0, 1.0),
...                     ([0.0, 3.0, 1.0], 1e-300, 1.0), ([0.0, 3.0, 1.0], 1.0, 1e-300)]]
[2, 1, 1, 1]

>>> import torch
>>> params = SamplingParams(temperature=0.0, logprobs=2)
>>> out = sample(torch.tensor([[0.0, 3.0, 1.0]]), [params], [None])[0]
>>> out.token_id, [t for t, _ in out.top_logprobs]
(1, [1, 2])

A presence penalty of 2 (prompt ``[0]``, token 1 generated once) turns greedy from token 1
(logit 3 - 2 = 1) to token 2; the reported logprobs are still the raw ones, where 1 leads:

>>> params = SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0)
>>> out = sample(torch.tensor([[0.0, 3.0, 1.5]]), [params], [None], tokens=[([0], [1])])[0]
>>> out.token_id, [t for t, _ in out.top_logprobs]
(2, [1, 2])
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from server.engine.constraints import Constraint
from server.engine.errors import InvalidRequest

if TYPE_CHECKING:
    from agentshare.protocol import SamplingSpec

MAX_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0
"""The log-probability reported for a token the row makes impossible."""
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's range)
GREEDY_BELOW = 1e-5  # a requested temperature under this samples greedily (as vLLM does)
MIN_TOP_P = 1e-6  # float32 rounds smaller values to 0, which would keep no token at all


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops. Validated on construction."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only; k: and top k
    forced_tokens: tuple[int, ...] = ()
    """Teacher forcing: emit these tokens in order instead of sampling (scoring a given
    continuation; its logprobs are reported as for sampled tokens). Sampling resumes after."""
    repetition_penalty: float = 1.0  # > 0; 1: off (HF/vLLM: prompt and output tokens)
    frequency_penalty: float = 0.0  # [-2, 2]; 0: off (OpenAI: per occurrence in the output)
    presence_penalty: float = 0.0  # [-2, 2]; 0: off (OpenAI: once per token in the output)
    constraint: Constraint | None = None
    """What the output must match (JSON Schema, regex, choice, grammar): tokens that cannot
    continue a match are masked out before sampling (``server/engine/constraints.py``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")
        if not _real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty must be a finite number > 0 (1 disables it, above 1 "
                                 f"discourages repeats), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _real(value) or not (-MAX_PENALTY <= value <= MAX_PENALTY):
                raise InvalidRequest(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g} "
                                     f"(0 disables it), got {value!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "forced_tokens", tuple(self.forced_tokens))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @classmethod
    def from_spec(cls, spec: SamplingSpec, *, default_max_tokens: int = 256) -> SamplingParams:
        """The parameters a request's :class:`~agentshare.protocol.SamplingSpec` asks for: its
        ``None`` fields take the server's defaults (OpenAI's: temperature 1, top_p 1), and values the
        request schemas accept but float32 sampling cannot represent are clamped to their meaning: a
        temperature below 1e-5 is greedy (as vLLM does), a top_p below 1e-6 keeps only the most likely
        token (which it does anyway for any vocabulary under a million tokens), a top_k of -1 is off.

        >>> from agentshare.protocol import SamplingSpec
        >>> p = SamplingParams.from_spec(SamplingSpec(top_k=-1), default_max_tokens=16)
        >>> p.max_tokens, p.temperature, p.top_k
        (16, 1.0, 0)
        >>> q = SamplingParams.from_spec(SamplingSpec(max_tokens=4, temperature=1e-300, top_p=1e-300))
        >>> q.max_tokens, q.temperature, q.top_p
        (4, 0.0, 1e-06)
        """
        given = {k: v for k, v in spec if v is not None}
        if spec.constraint is not None:
            given["constraint"] = Constraint(spec.constraint.kind, spec.constraint.value)
        given.setdefault("max_tokens", default_max_tokens)
        if "temperature" in given and given["temperature"] < GREEDY_BELOW:
            given["temperature"] = 0.0
        if "top_p" in given:
            given["top_p"] = max(given["top_p"], MIN_TOP_P)
        if "top_k" in given:
            given["top_k"] = max(given["top_k"], 0)
        return cls(**given)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty is set (the row's tokens so far are then needed to sample)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def generator(self) -> torch.Generator:
        """A fresh generator for one request: seeded, or from OS entropy."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else random.SystemRandom().getrandbits(63))
        return g


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    forced: Sequence[int | None] | None = None,
    *,
    tokens: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
) -> list[Sampled]:
    """One token per row of ``logits`` [rows, vocab]. ``generators[i]`` may be None for greedy
    rows; ``forced[i]``, if not None, is taken instead of sampling (teacher forcing).
    ``tokens[i]`` is row ``i``'s ``(prompt token ids, generated token ids so far)``, which the
    penalties read: a row with a penalty set and no ``tokens`` raises ``ValueError``. Penalties
    change the token chosen (greedy or drawn), never the logprobs reported (the raw model's)."""
    logits = _sanitize(logits.float())
    out: list[Sampled] = []
    want_lp = any(p.logprobs is not None for p in params)
    logprobs = _logprobs(logits) if want_lp else None
    for i, p in enumerate(params):
        if forced is not None and forced[i] is not None:
            token = int(forced[i])  # type: ignore[arg-type]
        else:
            token = _choose(logits[i], p, generators[i], None if tokens is None else tokens[i])
        if p.logprobs is None or logprobs is None:
            out.append(Sampled(token))
            continue
        lp = logprobs[i]
        top: list[tuple[int, float]] = []
        if p.logprobs:
            vals, idx = torch.topk(lp, p.logprobs)
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        out.append(Sampled(token, float(lp[token]), top))
    return out


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token, on the logits' device, in one op for all rows: the token that
    :func:`sample` picks for the row alone with plain greedy params (no penalty, no logprobs, no
    forced token). A row holding a NaN gets -1 instead: it goes through :func:`sample`, whose
    sanitizing reads NaN as ``-inf``. (torch's argmax returns the index of a NaN when a row holds
    one, and the first of equal maxima otherwise, the first ``+inf`` included, as sanitizing does.)

    >>> greedy_ids(torch.tensor([[0.0, 2.0, 1.0], [0.0, float("inf"), float("inf")], [1.0, float("nan"), 0.0]]))
    tensor([ 1,  1, -1])
    """
    # max(dim) returns the argmax's index (the first of equal maxima, a NaN's where there is one)
    # and the value with it: on CPUs it is 3-4x faster than argmax over a bf16 vocabulary row
    best, idx = logits.max(dim=-1)
    return idx.masked_fill(best.isnan(), -1)


def _choose(row: torch.Tensor, p: SamplingParams, g: torch.Generator | None,
            tokens: tuple[Sequence[int], Sequence[int]] | None) -> int:
    """The token of one sanitized row: penalized, then greedy or drawn."""
    if p.penalized:
        if tokens is None:
            raise ValueError("a row with a penalty set needs its tokens: (prompt ids, generated ids so far)")
        row = _penalize(row, p, *tokens)
    if p.greedy:
        return int(torch.argmax(row))
    if g is None:
        raise ValueError("a sampled (temperature > 0) row needs its generator")
    return _draw(row, p, g)


def _penalize(row: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """A sanitized row with the penalties applied. A finite logit stays finite (clamped to the
    row dtype's range: a division by a tiny penalty cannot make a ``+inf``; a zero stays zero), a
    ``-inf`` one stays ``-inf``, so every rule of the sanitized row still holds. Token ids outside
    the row are ignored. The penalties are computed in the row's dtype.

    >>> row = torch.tensor([2.0, -2.0, 1.0, 4.0])
    >>> _penalize(row, SamplingParams(repetition_penalty=2.0), [0], [1]).tolist()
    [1.0, -4.0, 1.0, 4.0]
    >>> _penalize(row, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [0], [3, 3, 2]).tolist()
    [2.0, -2.0, -0.5, 2.0]
    """
    vocab = row.numel()
    out = torch.tensor([t for t in output if 0 <= t < vocab], dtype=torch.long)
    new = row
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.long)] = True
        seen[out] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        new = torch.where(seen, scaled, new)
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        counts = torch.bincount(out, minlength=vocab).to(row.dtype)
        new = new - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(row.dtype)
    # nan_to_num: an overflow to +-inf becomes the dtype's largest finite value, and the one NaN a
    # finite logit can give (0 times a repetition penalty that is inf in float32, such as 1e300) is 0
    return torch.where(torch.isfinite(row), new.nan_to_num(), row)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """NaN as ``-inf``; a row holding ``+inf`` as the point mass on its first ``+inf`` (0 there,
    ``-inf`` elsewhere). Finite rows are returned as they are."""
    logits = logits.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    pos = torch.isposinf(logits)
    hit = pos.any(dim=-1, keepdim=True)
    if bool(hit.any()):
        point = torch.full_like(logits, float("-inf")).scatter_(-1, pos.to(torch.int8).argmax(-1, keepdim=True), 0.0)
        logits = torch.where(hit, point, logits)
    return logits


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, dim=-1)
    return lp.nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)


def _draw(row: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """Sample from a sanitized row; falls back to its argmax when nothing is left to draw from."""
    scaled = row / p.temperature
    if p.top_k and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p, and always the top token (top_p is
        # compared in float32: 1e-300 is 0 there, and would drop every token)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
        drop[0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0.0:  # scaling over/underflowed, or no finite logit
        return int(torch.argmax(row))
    # One fixed-size draw per step from the request's own generator: batch-independent.
    return int(torch.multinomial(probs, 1, generator=g))
