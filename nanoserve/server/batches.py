"""PLACEHOLDER while the batch API is being written (see issue 8); replaced by the real module."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter


class BatchService:
    def __init__(self, server: Any, state_dir: str | Path | None) -> None:
        self.server = server
        self.router = APIRouter()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
