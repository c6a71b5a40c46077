"""A resettable wake-up flag on anyio (asyncio or trio).

``anyio.Event`` cannot be cleared; the step loop and each stream need a flag that is set by
news, waited for, and cleared when the news is read (what ``asyncio.Event`` gave before).
"""

from __future__ import annotations

import anyio


class Wakeup:
    """A flag that :meth:`set` raises, :meth:`wait` waits for and :meth:`clear` lowers.

    Used from one event loop thread only. The anyio event under it is made on the first
    :meth:`wait` that has to block, so a ``Wakeup`` can be built outside an event loop.
    """

    __slots__ = ("_event", "_is_set")

    def __init__(self) -> None:
        self._is_set = False
        self._event: anyio.Event | None = None

    def set(self) -> None:
        """Raise the flag and wake every waiter."""
        self._is_set = True
        if self._event is not None:
            self._event.set()

    def clear(self) -> None:
        """Lower the flag (a waiter still blocked keeps waiting for the next :meth:`set`)."""
        self._is_set = False
        if self._event is not None and self._event.is_set():
            self._event = None

    def is_set(self) -> bool:
        """Whether the flag is raised."""
        return self._is_set

    async def wait(self) -> None:
        """Return when the flag is raised (at once, without a checkpoint, if it is)."""
        if self._is_set:
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()
