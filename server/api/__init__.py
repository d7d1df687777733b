"""The HTTP API of agentshare: OpenAI-compatible and native endpoints over one engine.

::

    create_app(engine, config) -> ASGI app      serve(config): load the engine and run uvicorn
"""

from server.api.config import ServerConfig

__all__ = ["ServerConfig"]
