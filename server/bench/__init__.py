"""``agentshare bench``: agent sessions against any OpenAI-compatible endpoint, under load.

A run drives sessions of a workload (:mod:`server.bench.workloads`: ``react``, ``reflexion``,
``burst``, ``trace:FILE``) at an offered load (Poisson session arrivals at a rate, or a fixed
number of concurrent sessions; :mod:`server.bench.load`), streams every request
(:mod:`server.bench.client`), samples the server's Prometheus counters while it runs
(:mod:`server.bench.counters`), and reports what ``vllm bench serve`` reports, plus sessions,
goodput and the cache hit ratio (:mod:`server.bench.metrics`; tables, capacity and plots in
:mod:`server.bench.report`). docs/bench.md has the command and the definitions.
"""

from server.bench.load import Load, Options, run_load
from server.bench.run import bench, served_models
from server.bench.workloads import make_workload

__all__ = ["Load", "Options", "bench", "make_workload", "run_load", "served_models"]
