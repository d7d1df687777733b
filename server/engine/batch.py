"""One forward step's batch: which tokens run, where their KV goes, what each token attends.

The caller (the scheduler) describes each request's part of a step as a :class:`Chunk`; the
step's :class:`StepPlan` is computed from them once, before the forward, and serves every
layer::

    request r:  positions 0 .. P-1 | P .. start-1 | start .. start+n-1
                 prefix (shared,    | history      | new tokens (their K/V are
                 consecutive blocks)| (own slots)  |  written to their slots)
                 ╰ Chunk.prefix     ╰──────── Chunk.slots ────────╯

Requests with the same :class:`SharedPrefix` form one *prefix group*: the prefix's K/V are read
once for all their queries. Requests with one new token (decode) attend their own slots in one
padded, masked batch; requests with a chunk of several tokens (chunked prefill) attend their
history and, causally, their own chunk.

>>> import torch
>>> pre = SharedPrefix(first_block=0, num_tokens=20)             # blocks 0, 1 (block size 16)
>>> a = Chunk([5], start=22, slots=torch.tensor([32, 33, 34]), prefix=pre)
>>> b = Chunk([7], start=20, slots=torch.tensor([48]), prefix=pre)
>>> plan = plan_step([a, b], block_size=16)
>>> plan.positions.tolist(), plan.write_slots.tolist(), plan.prefix_groups[0].rows
([22, 20], [34, 48], None)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Positions ``[0, num_tokens)`` of a request, in consecutive blocks from ``first_block``."""

    first_block: int
    num_tokens: int

    def __post_init__(self) -> None:
        if self.first_block < 0 or self.num_tokens < 0:
            raise ValueError(f"invalid shared prefix {self}")


@dataclass(frozen=True, slots=True)
class Chunk:
    """A request's new tokens in one step.

    ``slots`` are the KV slots of positions ``[prefix_len, start + n)`` in order: the request's
    history first (already written), then one slot per new token (written by this step).
    """

    token_ids: Sequence[int] | torch.Tensor
    start: int
    slots: torch.Tensor
    prefix: SharedPrefix | None = None

    @property
    def num_new(self) -> int:
        return len(self.token_ids)

    @property
    def prefix_len(self) -> int:
        return self.prefix.num_tokens if self.prefix is not None else 0

    def validate(self) -> None:
        n = self.num_new
        if n < 1:
            raise ValueError("a chunk needs at least one new token")
        if self.start < self.prefix_len:
            raise ValueError(f"chunk starts at {self.start}, inside its prefix of {self.prefix_len}")
        expected = self.start + n - self.prefix_len
        if self.slots.ndim != 1 or self.slots.numel() != expected:
            raise ValueError(
                f"chunk at {self.start} with {n} new tokens after a prefix of {self.prefix_len} "
                f"needs {expected} slots, got {tuple(self.slots.shape)}"
            )


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    """Query rows attending one shared prefix (slots ``[slot_start, slot_start + num_tokens)``)."""

    slot_start: int
    num_tokens: int
    rows: torch.Tensor | None  # None: every row of the step, in order
    member: torch.Tensor | None = None
    """With ``rows`` None, in a graph's padded step whose rows read several prefixes: [rows],
    0.0 for a row of this group and ``-inf`` for any other. Every row then attends the prefix
    (a fixed shape), and the rows outside the group get an LSE of ``-inf``: the prefix adds
    nothing to them."""


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Single-token requests: each attends its own slots through a padded gather + mask."""

    rows: torch.Tensor | None  # None: every row of the step, in order
    gather: torch.Tensor  # [R, Lmax] slots (padding repeats a valid slot)
    mask: torch.Tensor  # [R, 1, 1, Lmax] additive: 0 where attended, -inf on padding
    spans: tuple[slice, ...] | None = None
    """Each request's slots as one contiguous range, on the CPU, where all are and the longest
    reaches :data:`VIEW_MIN_SLOTS`: read as views, one request at a time, instead of gathered (a
    gather copies every history, every layer, every step)."""


VIEW_MIN_SLOTS = 256
"""The longest own history of a step's decodes from which they are read as views, not gathered."""


@dataclass(frozen=True, slots=True)
class WholeSequences:
    """A step laid out for kernels that read each request's whole sequence (its shared prefix,
    its history, then its new tokens) through a table of slots (:mod:`server.engine.vllm_attention`).

    Request ``r`` owns rows ``[starts[r], starts[r] + new[r])`` of the step, and its sequence is
    ``table[r, :lengths[r]]``, the new tokens' slots last.
    """

    table: torch.Tensor  # [R, L] int32: request r's slots in position order, then zeros
    lengths: torch.Tensor  # [R] int64
    new: torch.Tensor  # [R] int32: its new tokens (the last of its sequence)
    starts: torch.Tensor  # [R] int32: its first row in the step
    requests: torch.Tensor  # [R] int64: 0..R-1, the row of ``table`` each request reads
    loc: torch.Tensor  # [R] int64: the slot of each request's last token (where a decode kernel writes its K/V)
    max_new: int

    @property
    def decode_only(self) -> bool:
        """Every request has one new token."""
        return self.max_new == 1

    @classmethod
    def of(cls, slots: list[torch.Tensor], spans: Sequence[tuple[int, int]]) -> WholeSequences:
        """From each request's slots in position order and its rows ``[lo, hi)`` of the step.

        >>> seqs = WholeSequences.of([torch.arange(3), torch.tensor([7])], [(0, 2), (2, 3)])
        >>> seqs.table.tolist(), seqs.starts.tolist(), seqs.decode_only
        ([[0, 1, 2], [7, 0, 0]], [0, 2], False)
        """
        lengths = [int(s.numel()) for s in slots]
        table = torch.zeros(len(slots), max(lengths), dtype=torch.int32)
        for r, s in enumerate(slots):
            table[r, : lengths[r]] = s
        rows, new = len(slots), [hi - lo for lo, hi in spans]
        return cls(table, torch.tensor(lengths, dtype=torch.long), torch.tensor(new, dtype=torch.int32),
                   torch.tensor([lo for lo, _ in spans], dtype=torch.int32), torch.arange(rows),
                   torch.stack([s[-1] for s in slots]).long(), max(new))


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """A multi-token chunk: rows ``[lo, hi)`` attend their history and (causally) themselves."""

    lo: int
    hi: int
    history: slice | torch.Tensor | None  # a contiguous slot range, slot indices, or nothing


@dataclass(frozen=True, slots=True)
class StepPlan:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T]
    prefix_groups: tuple[PrefixGroup, ...]
    decode: DecodeGroup | None
    chunks: tuple[ChunkPart, ...]
    logit_rows: torch.Tensor | None  # rows whose logits are returned; None: all rows
    row_spans: tuple[tuple[int, int], ...] = field(default=())  # request i -> rows [lo, hi)
    max_position: int = 0  # the step's last position (known on the host, wherever the step runs)
    sequences: WholeSequences | None = None
    """Set when asked for (``plan_step``'s ``whole_sequences``), for the steps it names."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def attention_writes_kv(self) -> bool:
        """The step's attention writes its new K/V to ``write_slots`` as it reads (vLLM's decode
        kernel, for a step of single-token requests laid out whole); else the forward writes them
        before attending."""
        return self.sequences is not None and self.sequences.decode_only


def plan_step(
    chunks: Sequence[Chunk],
    *,
    block_size: int,
    all_logits: bool = False,
    mask_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    whole_sequences: int = 0,
) -> StepPlan:
    """Lay out one forward step. Logits: each request's last token, or every token.

    Rows follow the order of ``chunks``; request ``i`` owns rows ``plan.row_spans[i]``. With
    ``whole_sequences`` N > 0 the plan also lays out every request's whole sequence
    (:class:`WholeSequences`, on the host) for a step that reads no shared prefix, or whose
    requests are at most N single-token ones (over more, reading a shared prefix once wins). The
    cascade then hands the step to vLLM's kernels: ask only where they serve
    (:func:`server.engine.vllm_attention.serves`), as the runner does.
    """
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    ids, positions, writes, spans = [], [], [], []
    row = 0
    for c in chunks:
        c.validate()
        n = c.num_new
        ids.append(torch.as_tensor(c.token_ids, dtype=torch.long).reshape(-1))
        positions.append(torch.arange(c.start, c.start + n, dtype=torch.long))
        writes.append(c.slots[-n:].to(torch.long))
        spans.append((row, row + n))
        row += n
    total = row

    def as_rows(rows: list[int]) -> torch.Tensor | None:
        if rows == list(range(total)):
            return None
        return torch.tensor(rows, dtype=torch.long, device=device)

    groups: dict[SharedPrefix, list[int]] = {}
    for c, (lo, hi) in zip(chunks, spans, strict=True):
        if c.prefix is not None and c.prefix.num_tokens > 0:
            groups.setdefault(c.prefix, []).extend(range(lo, hi))
    prefix_groups = tuple(
        PrefixGroup(p.first_block * block_size, p.num_tokens, as_rows(rows))
        for p, rows in groups.items()
    )

    decode_idx = [i for i, c in enumerate(chunks) if c.num_new == 1]
    decode = None
    if decode_idx:
        lengths = [chunks[i].slots.numel() for i in decode_idx]
        width = max(lengths)
        gather = torch.empty(len(decode_idx), width, dtype=torch.long)
        mask = torch.full((len(decode_idx), 1, 1, width), float("-inf"), dtype=mask_dtype)
        for j, (i, n) in enumerate(zip(decode_idx, lengths, strict=True)):
            gather[j, :n] = chunks[i].slots
            gather[j, n:] = chunks[i].slots[-1]
            mask[j, ..., :n] = 0.0
        views = None  # a device gathers cheaply, and one kernel for all beats one per request
        if width >= VIEW_MIN_SLOTS and torch.device(device).type == "cpu":
            runs = tuple(_history(chunks[i].slots) for i in decode_idx)
            if all(isinstance(r, slice) for r in runs):
                views = cast(tuple[slice, ...], runs)
        decode = DecodeGroup(
            as_rows([spans[i][0] for i in decode_idx]), gather.to(device), mask.to(device), views
        )

    parts = []
    for c, (lo, hi) in zip(chunks, spans, strict=True):
        if c.num_new > 1:
            history = _history(c.slots[: -c.num_new])
            parts.append(ChunkPart(lo, hi, history.to(device) if isinstance(history, torch.Tensor) else history))

    logit_rows = None if all_logits else as_rows([hi - 1 for _, hi in spans])
    sequences = None
    if whole_sequences > 0 and (not prefix_groups or len(decode_idx) == len(chunks) <= whole_sequences):
        sequences = WholeSequences.of([
            c.slots if c.prefix is None else
            torch.cat([torch.arange(c.prefix.first_block * block_size,
                                    c.prefix.first_block * block_size + c.prefix.num_tokens), c.slots])
            for c in chunks], spans)
    return StepPlan(
        token_ids=torch.cat(ids).to(device),
        positions=torch.cat(positions).to(device),
        write_slots=torch.cat(writes).to(device),
        prefix_groups=prefix_groups,
        decode=decode,
        chunks=tuple(parts),
        logit_rows=logit_rows,
        row_spans=tuple(spans),
        max_position=max(c.start + c.num_new - 1 for c in chunks),
        sequences=sequences,
    )


def _history(slots: torch.Tensor) -> slice | torch.Tensor | None:
    """A contiguous run of slots becomes a slice (read as a view, never copied)."""
    if slots.numel() == 0:
        return None
    first = int(slots[0])
    if slots.numel() == 1 or bool((slots[1:] - slots[:-1] == 1).all()):
        return slice(first, first + slots.numel())
    return slots.to(torch.long)
