"""The one interface every replica source implements."""

from __future__ import annotations

from typing import Protocol

from kubeshard_router.backends.registry import Registry


class BackendSource(Protocol):
    """Declares models and their replica leaders into the registry, and keeps them current."""

    async def start(self, registry: Registry) -> None:
        """Declares what is known now (returns quickly) and starts watching for changes."""

    async def stop(self) -> None:
        """Stops watching; the registry keeps what was declared."""

    def static_models(self) -> list[str]:
        """Models whose replicas must all have answered Info before the router is ready."""
