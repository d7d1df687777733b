"""agentshare: multi-agent LLM apps whose agents share one prefill of their common context.

::

    AsyncClient ──context()──> SharedContext ──generate / stream / fork / extend──> Answer, ForkResult
         │                          ▲
         └── agents(), explain(), metrics()      Agent: name, module, instruction, sampling

>>> from agentshare import Agent, Sampling
>>> Agent("coder", instruction="Write the code.", sampling=Sampling(max_tokens=128)).module
'base'
>>> async with AsyncClient(url) as client:      # a running server; AsyncClient() launches one
...     ctx = await client.context("Design: one replica per zone. SLO: 99.9 % of reads in 50 ms.")
...     team = await ctx.fork([Agent("retriever", instruction="Quote the SLO."),
...                            Agent("planner", instruction="Plan the migration.")], max_tokens=8)
>>> [(answer.agent, answer.usage.cached_tokens) for answer in team]   # both read the context's KV
[('retriever', 48), ('planner', 48)]
"""

from agentshare.agent import Agent, Sampling
from agentshare.client import AsyncClient, CacheExplanation, ServedAgent, Team
from agentshare.context import SharedContext
from agentshare.errors import (
    AgentshareError,
    APIError,
    AuthenticationError,
    BadRequestError,
    ConnectionFailed,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    ServerStartError,
)
from agentshare.metrics import ServerMetrics
from agentshare.results import Answer, Chunk, ForkResult, Timings, Usage

__version__ = "0.1.0.dev0"

__all__ = [
    "APIError",
    "Agent",
    "AgentshareError",
    "Answer",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "CacheExplanation",
    "Chunk",
    "ConnectionFailed",
    "ForkResult",
    "InternalServerError",
    "NotFoundError",
    "RateLimitError",
    "Sampling",
    "ServedAgent",
    "ServerMetrics",
    "ServerStartError",
    "SharedContext",
    "Team",
    "Timings",
    "Usage",
]
