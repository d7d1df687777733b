import pytest

from server.policy import OffloadPolicy
from server.sim import ClusterConfig, ServiceProfile

# Round numbers for hand-computed timings: 1,000 tok/s prefill; a decode step takes 0.1 s at
# any batch (10 tok/s at batch 1, 20 at batch 2); 1,000 bytes of KV per token; no pipelining.
TOY = ServiceProfile(
    name="toy", prefill_tok_s=1000.0, decode_tok_s=((1, 10.0), (2, 20.0)),
    kv_bytes_per_token=1000, kv_capacity_bytes=10**9, prefill_chunk_tokens=1000, layers=1,
)
LOCAL = OffloadPolicy(threshold_tokens=None)
NAIVE = OffloadPolicy(threshold_tokens=0, bandwidth_aware=False)


def toy_cluster(**kw) -> ClusterConfig:  # type: ignore[no-untyped-def]
    base = dict(prefill_workers=1, decode_workers=1, prefill_profile=TOY, block_tokens=100,
                link_bandwidth_bytes_s=1e6, link_latency_s=0.01, policy=LOCAL)
    base.update(kw)
    return ClusterConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def toy() -> ServiceProfile:
    return TOY
