"""Admission in the front end: the limits on waiting requests, callers that wait for a place,
tenants, deadlines, and the queue positions a stream can report before it starts.

A call's requests count as waiting from the moment it is checked (while its prompt is
tokenized) until the core schedules them. ``EngineConfig.max_waiting`` bounds them all and
``EngineConfig.max_waiting_per_tenant`` each tenant's. A call that does not fit raises
:class:`~asyncllm.errors.QueueFull` at once (``admission="refuse"``, the default), or with
``admission="wait"`` is held in the front end, in arrival order, and handed to the core as soon
as places free (its ``timeout`` and ``deadline`` run while it is held; a cancelled caller
leaves the line). A stream with ``report_queue=True`` gets, before its first token, items
with its ``queue_position`` (requests that start before it) and ``estimated_start_s``
(the position over the rate at which requests started recently).

Nothing here holds model state; it runs on the engine's event loop.
"""

from __future__ import annotations

import collections
import datetime
import math
import time
from collections.abc import Callable

from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidRequestError, QueueFull

__all__ = ["ADMISSION_MODES", "AdmissionLimits", "StartRate", "check_deadline", "check_tenant"]

ADMISSION_MODES = ("refuse", "wait")
"""``admission=`` values: "refuse" raises QueueFull on a full queue, "wait" waits for a place."""

#: Recent starts the estimated start time is computed from.
_RATE_WINDOW = 64


def check_tenant(tenant: object) -> str:
    """The tenant name checked.

    Raises:
        InvalidRequestError: not a str, or longer than 256 characters.
    """
    if not isinstance(tenant, str) or len(tenant) > 256:
        raise InvalidRequestError(f"tenant must be a str of at most 256 characters, got {tenant!r}")
    return tenant


def check_deadline(deadline: object, now: float) -> float | None:
    """The deadline as a ``time.monotonic()`` instant.

    Args:
        deadline: None, seconds from now (a positive finite number), or an aware
            :class:`datetime.datetime` (an absolute instant, in the past or not).
        now: ``time.monotonic()`` of the call.

    Raises:
        InvalidRequestError: any other value (a naive datetime included: its zone is unknown).
    """
    if deadline is None:
        return None
    if isinstance(deadline, datetime.datetime):
        if deadline.tzinfo is None:
            raise InvalidRequestError("deadline must be a timezone-aware datetime")
        wall = datetime.datetime.now(datetime.timezone.utc)
        return now + (deadline - wall).total_seconds()
    if (
        isinstance(deadline, (int, float))
        and not isinstance(deadline, bool)
        and 0 < deadline < math.inf
    ):
        return now + deadline
    raise InvalidRequestError(
        f"deadline must be None, a positive number of seconds or an aware datetime, "
        f"got {deadline!r}"
    )


def check_admission_mode(admission: object) -> bool:
    """True for "wait", False for "refuse".

    Raises:
        InvalidRequestError: anything else.
    """
    if admission not in ADMISSION_MODES:
        raise InvalidRequestError(f"admission must be one of {ADMISSION_MODES}, got {admission!r}")
    return admission == "wait"


class AdmissionLimits:
    """``max_waiting`` and ``max_waiting_per_tenant`` against the waiting counts.

    Args:
        config: the engine's settings (read at each check).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        #: Requests of calls being tokenized (or rendered, or compiled) now, per tenant.
        self.tokenizing: collections.Counter[str] = collections.Counter()

    @property
    def max_waiting(self) -> int | None:
        """The most waiting requests (None: unbounded)."""
        return self.config.max_waiting

    @property
    def per_tenant(self) -> int | None:
        """The most waiting requests of one tenant (None: unbounded)."""
        return self.config.max_waiting_per_tenant

    def check_size(self, adding: int) -> None:
        """Raise InvalidRequestError for a call that never fits: it would wait (or be
        retried by a client on 429) forever."""
        limits = {"max_waiting": self.max_waiting, "max_waiting_per_tenant": self.per_tenant}
        for name, limit in limits.items():
            if limit is not None and adding > limit:
                raise InvalidRequestError(
                    f"this call adds {adding} requests (its prompts' n samples), more than "
                    f"EngineConfig.{name}={limit} ever holds; lower n or raise {name}"
                )

    def blocking(self, waiting: int, tenant_waiting: int, adding: int) -> str | None:
        """The limit (its field's name) that ``adding`` more requests would pass beside
        ``waiting`` (``tenant_waiting`` of their tenant), the engine's first; None: they fit."""
        if self.max_waiting is not None and waiting + adding > self.max_waiting:
            return "max_waiting"
        if self.per_tenant is not None and tenant_waiting + adding > self.per_tenant:
            return "max_waiting_per_tenant"
        return None

    def check(self, waiting: int, tenant_waiting: int, adding: int) -> None:
        """Refuse a call that does not fit now.

        Raises:
            InvalidRequestError: as :meth:`check_size`.
            QueueFull: no room for it now (the message names the limit).
        """
        self.check_size(adding)
        limit = self.blocking(waiting, tenant_waiting, adding)
        if limit == "max_waiting":
            raise QueueFull(
                f"{waiting} requests are waiting and this one adds {adding} "
                f"(EngineConfig.max_waiting={self.max_waiting}); try again later"
            )
        if limit is not None:
            raise QueueFull(
                f"{tenant_waiting} requests of this tenant are waiting and this one adds "
                f"{adding} (EngineConfig.max_waiting_per_tenant={self.per_tenant}); "
                "try again later"
            )


class StartRate:
    """The rate at which requests started recently, for estimated start times.

    Args:
        clock: seconds, monotonic.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._starts: collections.deque[float] = collections.deque(maxlen=_RATE_WINDOW)
        self._clock = clock

    def note(self, num_started: int) -> None:
        """Count ``num_started`` requests that started now."""
        now = self._clock()
        self._starts.extend([now] * min(num_started, _RATE_WINDOW))

    def eta(self, position: int) -> float | None:
        """Estimated seconds until the request at ``position`` starts: ``position + 1``
        starts at the recent rate; None before two starts at distinct times."""
        starts = self._starts
        if len(starts) < 2 or starts[-1] <= starts[0]:
            return None
        rate = (len(starts) - 1) / (starts[-1] - starts[0])
        return (position + 1) / rate
