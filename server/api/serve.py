"""Start a server: load the engine, build the app, run it under uvicorn.

``serve`` blocks until interrupted (``agentshare serve`` calls it); here, in a child process:

>>> from multiprocessing import get_context
>>> import httpx
>>> from server.process import free_port
>>> config = ServerConfig(model_dir=model_dir, dtype="float32", port=free_port(), log_level="warning")
>>> server = get_context("spawn").Process(target=serve, args=(config,))
>>> server.start()
>>> with httpx.Client(transport=httpx.HTTPTransport(retries=8)) as http:   # retried while it loads
...     http.get(f"http://127.0.0.1:{config.port}/health").json()["agents"]
1
>>> server.terminate(); server.join()                 # SIGTERM: uvicorn shuts down gracefully
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from server.api.config import ServerConfig

log = logging.getLogger("agentshare.api")


def serve(config: ServerConfig) -> None:
    """Serve until interrupted (blocks)."""
    import uvicorn

    from server import tracing
    from server.api.app import create_app
    from server.api.logs import configure_logging
    from server.engine.build import start_engine

    configure_logging(config.log_level)
    tracing.configure("agentshare")
    engine = start_engine(config.model_dir, modules=config.modules, dtype=config.dtype, threads=config.threads,
                          config=config.engine_config(), base_name=config.base_name, device=config.device)
    core = engine.core
    for name, m in core.modules.items():
        log.info("agent", extra={"event": "agent", "agent": name, "kind": str(m.kind),
                                 "shares_prefill": m.shares_prefill, "reason": m.reason})
    app = create_app(engine, config, owns_engine=True)
    uvicorn.run(app, host=config.host, port=config.port, log_config=None, access_log=False,
                log_level=config.log_level.lower(), timeout_graceful_shutdown=5)


def config_from_options(opts: dict[str, Any]) -> ServerConfig:
    """A :class:`ServerConfig` from the ``agentshare serve`` options.

    >>> cfg = config_from_options({"module": ["coder=/m/coder"], "kv_cache": "64MiB", "api_key": None})
    >>> cfg.modules, cfg.kv_cache_bytes
    ({'coder': PosixPath('/m/coder')}, 67108864)
    >>> config_from_options({"kv_cache": "auto", "device": "cpu"}).kv_cache_bytes is None
    True
    """
    modules: dict[str, Path] = {}
    for spec in opts.get("module") or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--module expects NAME=PATH, got {spec!r}")
        if name in modules:
            raise ValueError(f"--module {name!r} given twice")
        modules[name] = Path(path).expanduser()
    fields = {
        "host": opts.get("host"), "port": opts.get("port"), "model_dir": opts.get("model"),
        "dtype": opts.get("dtype"), "threads": opts.get("threads"), "max_running": opts.get("max_running"),
        "max_waiting": opts.get("queue_limit"), "log_level": opts.get("log_level"),
        "context_ttl": opts.get("context_ttl"), "max_pinned_contexts": opts.get("max_pinned_contexts"),
        "max_pinned_share": opts.get("max_pinned_share"), "step_timeout": opts.get("step_timeout"),
        "device": opts.get("device"), "memory_utilization": opts.get("gpu_memory_utilization"),
    }
    kv_cache = (opts.get("kv_cache") or "auto").strip()
    return ServerConfig(
        modules=modules, api_keys=tuple(opts.get("api_key") or ()),
        kv_cache_bytes=None if kv_cache.lower() == "auto" else parse_bytes(kv_cache),
        **{k: v for k, v in fields.items() if v is not None},
    )


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912; plain numbers are bytes.

    >>> parse_bytes("2GiB"), parse_bytes("1.5k"), parse_bytes("4096")
    (2147483648, 1536, 4096)
    """
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
             "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        value = float(num) * units[t[len(num):]]
    except (KeyError, ValueError):
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB or 2GiB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)
