"""The server's counters that tell what sharing saved, read from its Prometheus ``/metrics``.

Only the few figures the SDK shows are parsed; :attr:`ServerMetrics.samples` keeps every
sample for the rest. Subtract two snapshots to see what happened in between. Against a router
the figures are its workers' summed, each token counted once: ``prompt_tokens`` (once per
request) is ``computed_tokens + reused_tokens + imported_tokens``, and what prefill workers
computed for the decode workers is apart (``exported_tokens``), in colocated and disaggregated
modes alike.

>>> text = '''# HELP agentshare_prefill_tokens_total Prompt tokens
... agentshare_prefill_tokens_total{source="computed"} 120.0
... agentshare_prefill_tokens_total{source="cached"} 480.0
... agentshare_cache_blocks_total{outcome="cross_module_hit"} 30.0
... agentshare_requests_running 1.0'''
>>> m = ServerMetrics.parse(text)
>>> m.prefill_computed_tokens, m.prefill_cached_tokens, m.requests_running
(120, 480, 1)
>>> (m - ServerMetrics.parse('agentshare_prefill_tokens_total{source="computed"} 100.0')).prefill_computed_tokens
20
>>> m = ServerMetrics.parse('''agentshare_prompt_tokens_total 600.0
... agentshare_prefix_tokens_total{role="decode",source="computed"} 120.0
... agentshare_prefix_tokens_total{role="decode",source="reused"} 200.0
... agentshare_prefix_tokens_total{role="decode",source="imported"} 280.0
... agentshare_prefix_tokens_total{role="prefill",source="computed"} 280.0''')
>>> m.prompt_tokens == m.computed_tokens + m.reused_tokens + m.imported_tokens, m.exported_tokens
(True, 280)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

Labels = tuple[tuple[str, str], ...]
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, Labels], float]:
    """``{(name, sorted labels): value}`` of a Prometheus text exposition."""
    out: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        out[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = v
    return out


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """A snapshot of the server's counters (cumulative since it started) and gauges."""

    prefill_computed_tokens: int = 0  # prompt positions prefilled, by every worker (all the prefill work)
    prefill_cached_tokens: int = 0  # prompt tokens not computed by their request (reused + imported)
    cross_module_hit_blocks: int = 0  # blocks one agent read that another agent's request computed
    decode_tokens: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    contexts_pinned: int = 0
    prompt_tokens: int = 0  # once per request
    computed_tokens: int = 0  # of prompt_tokens: computed by the engine serving the request
    reused_tokens: int = 0  # of prompt_tokens: read from that engine's own cache
    imported_tokens: int = 0  # of prompt_tokens: KV that came over a link from a prefill worker
    exported_tokens: int = 0  # computed by prefill workers for requests the decode workers serve
    split_prefix_tokens: int = 0  # prefix positions layer-split agents filled: their top layers only
    split_saved_layer_rows: int = 0  # (position, layer) pairs those read from the shared prefill
    samples: Mapping[tuple[str, Labels], float] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    @classmethod
    def parse(cls, text: str) -> ServerMetrics:
        s = parse_prometheus(text)

        def get(name: str, **labels: str) -> int:
            return int(s.get((name, tuple(sorted(labels.items()))), 0.0))

        return cls(
            prefill_computed_tokens=get("agentshare_prefill_tokens_total", source="computed"),
            prefill_cached_tokens=get("agentshare_prefill_tokens_total", source="cached"),
            prompt_tokens=get("agentshare_prompt_tokens_total"),
            computed_tokens=get("agentshare_prefix_tokens_total", role="decode", source="computed"),
            reused_tokens=get("agentshare_prefix_tokens_total", role="decode", source="reused"),
            imported_tokens=get("agentshare_prefix_tokens_total", role="decode", source="imported"),
            exported_tokens=get("agentshare_prefix_tokens_total", role="prefill", source="computed"),
            cross_module_hit_blocks=get("agentshare_cache_blocks_total", outcome="cross_module_hit"),
            decode_tokens=get("agentshare_decode_tokens_total"),
            requests_running=get("agentshare_requests_running"),
            requests_waiting=get("agentshare_requests_waiting"),
            contexts_pinned=get("agentshare_contexts_pinned"),
            split_prefix_tokens=get("agentshare_split_prefix_tokens_total"),
            split_saved_layer_rows=get("agentshare_split_saved_layer_rows_total"),
            samples=MappingProxyType(s),
        )

    def __sub__(self, earlier: ServerMetrics) -> ServerMetrics:
        """Counters accumulated since ``earlier`` (gauges: this snapshot's values)."""
        return ServerMetrics(
            prefill_computed_tokens=self.prefill_computed_tokens - earlier.prefill_computed_tokens,
            prefill_cached_tokens=self.prefill_cached_tokens - earlier.prefill_cached_tokens,
            prompt_tokens=self.prompt_tokens - earlier.prompt_tokens,
            computed_tokens=self.computed_tokens - earlier.computed_tokens,
            reused_tokens=self.reused_tokens - earlier.reused_tokens,
            imported_tokens=self.imported_tokens - earlier.imported_tokens,
            exported_tokens=self.exported_tokens - earlier.exported_tokens,
            cross_module_hit_blocks=self.cross_module_hit_blocks - earlier.cross_module_hit_blocks,
            decode_tokens=self.decode_tokens - earlier.decode_tokens,
            split_prefix_tokens=self.split_prefix_tokens - earlier.split_prefix_tokens,
            split_saved_layer_rows=self.split_saved_layer_rows - earlier.split_saved_layer_rows,
            requests_running=self.requests_running, requests_waiting=self.requests_waiting,
            contexts_pinned=self.contexts_pinned, samples=self.samples,
        )
