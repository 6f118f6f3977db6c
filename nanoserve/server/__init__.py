"""nanoserve's OpenAI-compatible HTTP server.

    from nanoserve.builder import build_engine
    from nanoserve.config import EngineArgs
    from nanoserve.async_engine import AsyncEngine
    from nanoserve.server import create_app

    app = create_app(AsyncEngine.build(lambda: build_engine(EngineArgs())))   # then: uvicorn.run(app)

`nanoserve serve` (server/serve.py) does exactly this from the command line.
"""
from nanoserve.server.app import create_app
from nanoserve.server.errors import APIError

__all__ = ["create_app", "APIError"]
