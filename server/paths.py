"""Where agentshare keeps files it derives once per machine (converted models, digests).

>>> isinstance(cache_dir(), Path)
True
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "AGENTSHARE_CACHE_DIR"


def cache_dir() -> Path:
    """``$AGENTSHARE_CACHE_DIR``, or ``~/.cache/agentshare``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentshare"
