"""A discrete-event simulator of a disaggregated prefill/decode cluster, with no model.

One noun per module::

    profile.py    ServiceProfile: prefill tok/s, decode step time by batch, KV bytes per token
                  (CPU_SMOLLM2_135M measured here; GPU_LLAMA8B_H100/H20 assumed)
    workload.py   SimRequest; the Mooncake trace; synthetic multi-agent sessions
    cache.py      PrefixCache: each worker's real BlockPool, one block per block id
    workers.py    PrefillWorker, DecodeWorker, Link: service-time models
    simulator.py  ClusterConfig, Simulator: the event loop; calls server.policy.place()
    metrics.py    RequestRecord, Summary: TTFT/E2E/TPOT percentiles, throughput, hit ratio, bytes

>>> from server.sim import ClusterConfig, MultiAgentWorkload, Simulator
>>> reqs = MultiAgentWorkload(sessions=2, agents=3, context_tokens=1024).requests()
>>> res = Simulator(ClusterConfig()).run(reqs)
>>> res.summary.completed, round(res.summary.hit_ratio, 2)
(6, 0.63)
"""

from server.sim.metrics import Distribution, RequestRecord, Summary, summarize
from server.sim.profile import (
    CPU_SMOLLM2_135M,
    GPU_LLAMA8B_H20,
    GPU_LLAMA8B_H100,
    ServiceProfile,
    kv_bytes_per_token,
)
from server.sim.simulator import ClusterConfig, SimResult, Simulator
from server.sim.workload import MultiAgentWorkload, SimRequest, from_trace

__all__ = [
    "CPU_SMOLLM2_135M",
    "GPU_LLAMA8B_H20",
    "GPU_LLAMA8B_H100",
    "ClusterConfig",
    "Distribution",
    "MultiAgentWorkload",
    "RequestRecord",
    "ServiceProfile",
    "SimRequest",
    "SimResult",
    "Simulator",
    "Summary",
    "from_trace",
    "kv_bytes_per_token",
    "summarize",
]
