"""The ``with`` statement for every face of the store, written once.

Each face (``TieredStore``, ``AsyncTieredStore``, the daemon's clients and
the embedded ones) owns what it opened and says how to let it go in
``close``; these bases turn that into a context manager.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self


class Closing(abc.ABC):
    """``with face: ...`` closes the face on the way out."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of everything the face holds (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClosing(abc.ABC):
    """``async with face: ...`` closes the face on the way out."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Let go of everything the face holds (idempotent)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
