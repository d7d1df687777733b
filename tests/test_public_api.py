"""The SDK's public surface: ``agentshare.__all__`` is pinned here, and every name in it is
importable and documented (as httpx pins its own).

Adding or removing a public name means updating :data:`PUBLIC` in the same change: the test
fails otherwise, so the surface never changes by accident.
"""

from __future__ import annotations

import importlib
import types

import agentshare

PUBLIC = [
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


def test_all_is_pinned_and_sorted() -> None:
    assert agentshare.__all__ == PUBLIC, (
        "agentshare.__all__ changed: added "
        f"{sorted(set(agentshare.__all__) - set(PUBLIC))}, removed {sorted(set(PUBLIC) - set(agentshare.__all__))}, "
        "or reordered; a public name is a promise to users: update PUBLIC in tests/test_public_api.py with it"
    )
    assert sorted(PUBLIC) == PUBLIC, "keep __all__ sorted"


def test_every_public_name_in_the_package_namespace_is_in_all() -> None:
    """A name imported into ``agentshare/__init__.py`` is public: it must be in ``__all__``."""
    exposed = sorted(n for n, v in vars(agentshare).items()
                     if not n.startswith("_") and not isinstance(v, types.ModuleType))
    assert exposed == PUBLIC, (
        f"names in agentshare's namespace but not in __all__: {sorted(set(exposed) - set(PUBLIC))}; "
        f"in __all__ but not defined: {sorted(set(PUBLIC) - set(exposed))}"
    )


def test_every_public_name_is_importable_and_documented() -> None:
    undocumented = []
    for name in PUBLIC:
        obj = getattr(agentshare, name)
        home = importlib.import_module(obj.__module__)  # where users' tracebacks and docs point
        assert obj.__module__.startswith("agentshare"), f"{name} comes from {obj.__module__}, not the SDK"
        assert getattr(home, name) is obj, f"{name} is not {obj.__module__}.{name}"
        doc = obj.__doc__ if "__doc__" in vars(obj) else None
        # a dataclass without a docstring gets its signature as __doc__: that is not documentation
        if not doc or not doc.strip() or doc.startswith(f"{name}("):
            undocumented.append(f"{obj.__module__}.{name}")
    assert not undocumented, f"public names without a docstring of their own: {undocumented}"
