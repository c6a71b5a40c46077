"""Waking the event loop (anyio: asyncio or trio): a resettable flag, and the end of work
on another thread.

``anyio.Event`` cannot be cleared; the step loop and each stream need a flag that is set by
news, waited for, and cleared when the news is read (what ``asyncio.Event`` gave before).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import anyio

_T = TypeVar("_T")


async def wait_future(future: Future[_T]) -> _T:
    """The result of ``future`` (work submitted to a thread of one's own, such as the
    engine's compute thread), waited for without blocking the loop, and waited for to its
    end even when the caller is cancelled (the work cannot be interrupted; the cancellation
    is delivered at the caller's next checkpoint).

    The thread that ends the work schedules the wake-up on the loop and returns at once
    (``loop.call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon`` on trio), as
    ``loop.run_in_executor`` does: ``anyio.from_thread.run_sync`` would hold that thread
    until the loop ran the call, and it then waits for the GIL while the loop handles the
    step's outputs (measured: a few ms per step at batch 1).

    Raises:
        whatever the work raised.
    """
    done = anyio.Event()
    soon = _call_soon_threadsafe()
    future.add_done_callback(lambda _: soon(done.set))
    with anyio.CancelScope(shield=True):
        await done.wait()
    return future.result()


def _call_soon_threadsafe() -> Callable[[Callable[[], object]], object]:
    """A function that any thread may call to run a callback soon on the current loop,
    without waiting for it."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: anyio's other backend, trio
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


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
