"""Fair shares in the scheduler: between tenants, and between the calls of several samples.

Two levels share the running slots (``max_num_seqs``), within a priority band:

* tenants (``Request.tenant``; every request without one is the shared tenant ``""``): the
  active tenants (with a request waiting or running) share the slots in proportion to their
  weights, ``max(1, floor(max_num_seqs * w / W))`` for a tenant of weight ``w`` when the
  active ones weigh ``W`` together;
* calls of several parallel samples (``Request.group_id``): while one runs, the calls of a
  tenant share its slots evenly, ``max(1, tenant_share // calls)``; a plain request is a call
  of its own and never above its share.

A request whose tenant or call holds (or, once admitted, would hold) more than its share is
*over share*: it is admitted after the other waiting requests of its priority, only into
slots beyond one kept free for each other active tenant below its share
(:meth:`FairShare.headroom`: that tenant's next request starts at once, with no preemption),
and the scheduler preempts such requests for waiting ones within their share
(:meth:`FairShare.victim`).

The token budget and the order of admission within a priority band follow each tenant's
virtual token counter, the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024): every token a step computes for a tenant adds ``1 / w`` to its
counter, the tenant with the lowest counter goes first, and a tenant that becomes active is
lifted to the lowest counter of the active ones, so that idle time banks no credit. With one
tenant every counter is equal and nothing changes the scheduler's order.

Pure Python, as the rest of the core.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from asyncllm.core.request import Request, RequestStatus

__all__ = ["DEFAULT_TENANT", "MAX_WEIGHT", "FairShare"]

DEFAULT_TENANT = ""
"""The tenant of every request that names none."""

MAX_WEIGHT = 1e6
"""The largest tenant weight (shares are ratios of weights: a bound keeps them finite)."""

# Idle tenants' counters kept beyond this many (plus the active ones) are pruned.
_MAX_IDLE_COUNTERS = 256


class FairShare:
    """The scheduler's fair-share state (see the module docstring).

    Args:
        max_num_seqs: the most requests running at once (the slots shared).
        weights: tenant -> weight (> 0); a tenant not named weighs 1.

    Raises:
        ValueError: a weight that is not a positive finite number.
    """

    def __init__(self, max_num_seqs: int, weights: Mapping[str, float] | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.weights: dict[str, float] = {}
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)
        self._active: Counter[str] = Counter()  # tenant -> requests in the scheduler
        self._counters: dict[str, float] = {}  # tenant -> virtual tokens served
        self._tenant_running: Counter[str] = Counter()
        self._call_running: Counter[str] = Counter()
        self._tenant_share: dict[str, int] = {}
        self._tenant_priority: dict[str, int] = {}
        self._call_share: dict[str, int] = {}

    def set_weight(self, tenant: str, weight: float) -> None:
        """Give ``tenant`` a share weight (applies from the next step).

        Raises:
            ValueError: ``weight`` is not a positive finite number.
        """
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            raise ValueError(f"tenant weight must be a number, got {weight!r}")
        if not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"tenant weight must be in (0, {MAX_WEIGHT:g}], got {weight!r}")
        self.weights[tenant] = float(weight)

    def weight(self, tenant: str) -> float:
        """The tenant's weight (1 unless set)."""
        return self.weights.get(tenant, 1.0)

    # ------------------------------------------------------------------ virtual counters

    def arrive(self, request: Request) -> None:
        """Count a request entering the scheduler; a tenant that becomes active is lifted to
        the lowest counter of the other active tenants."""
        tenant = request.tenant
        if self._active[tenant] == 0:
            others = [self._counters.get(t, 0.0) for t in self._active if t != tenant]
            if others:
                self._counters[tenant] = max(self._counters.get(tenant, 0.0), min(others))
        self._active[tenant] += 1

    def leave(self, request: Request) -> None:
        """Count a request leaving the scheduler (finished or aborted)."""
        tenant = request.tenant
        self._active[tenant] -= 1
        if self._active[tenant] > 0:
            return
        del self._active[tenant]
        if not self._active:  # an idle engine: everyone starts level
            self._counters.clear()
        elif len(self._counters) > len(self._active) + _MAX_IDLE_COUNTERS:
            # An idle tenant at or under the lowest active counter is lifted to it anyway.
            floor = min(self._counters.get(t, 0.0) for t in self._active)
            self._counters = {
                t: c for t, c in self._counters.items() if t in self._active or c > floor
            }

    def charge(self, request: Request, num_tokens: int) -> None:
        """Add ``num_tokens`` computed for ``request`` to its tenant's counter."""
        tenant = request.tenant
        self._counters[tenant] = self._counters.get(tenant, 0.0) + num_tokens / self.weight(tenant)

    def counter(self, request: Request) -> float:
        """The virtual tokens served to the request's tenant (lower goes first)."""
        return self._counters.get(request.tenant, 0.0)

    @property
    def num_active_tenants(self) -> int:
        """Tenants with a request waiting or running."""
        return len(self._active)

    # ------------------------------------------------------------------ running slots

    def refresh(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Count the running requests per tenant and per call of several samples, and each
        tenant's and call's share of the slots."""
        self._tenant_running = Counter(r.tenant for r in running)
        self._call_running = Counter(r.group_id for r in running if r.group_id)
        tenants: dict[str, set[str]] = {}  # tenant -> its calls that want slots
        best: dict[str, int] = {}  # tenant -> its best (lowest) priority
        for r in (*running, *waiting):
            tenants.setdefault(r.tenant, set()).add(r.group_id or r.request_id)
            best[r.tenant] = min(best.get(r.tenant, r.priority), r.priority)
        self._tenant_priority = best
        total = sum(self.weight(t) for t in tenants)
        self._tenant_share = {
            t: max(1, int(self.max_num_seqs * (self.weight(t) / total))) for t in tenants
        }
        if not self._call_running:  # no call of several samples runs: none is above
            self._call_share = {}
            return
        self._call_share = {
            t: max(1, self._tenant_share[t] // len(calls)) for t, calls in tenants.items()
        }

    @property
    def contended(self) -> bool:
        """Shares can differ from first come, first served (as of the last refresh): several
        tenants are active or a call of several samples runs."""
        return len(self._tenant_share) > 1 or bool(self._call_running)

    def over_share(self, request: Request) -> bool:
        """Whether the request's tenant or call holds (or, once it is admitted, would hold)
        more than its share of running slots."""
        extra = request.status is not RequestStatus.RUNNING
        tenant = request.tenant
        share = self._tenant_share.get(tenant, self.max_num_seqs)
        if len(self._tenant_share) > 1 and self._tenant_running[tenant] + extra > share:
            return True
        if request.group_id is None:
            return False
        call_share = self._call_share.get(tenant, self.max_num_seqs)
        return self._call_running[request.group_id] + extra > call_share

    def headroom(self, request: Request) -> int:
        """Slots an over-share ``request`` leaves free: one for each other active tenant of
        the same or a better priority holding fewer running requests than its share.
        Without them every arrival of a steady tenant finds the slots full and preempts
        (swaps out) a request of a tenant that filled them, which then finishes in smaller
        batches."""
        running, best = self._tenant_running, self._tenant_priority
        return sum(
            1
            for t, share in self._tenant_share.items()
            if t != request.tenant and running[t] < share and best[t] <= request.priority
        )

    def admitted(self, request: Request) -> bool:
        """Count a newly admitted request; True when its tenant or call just reached its
        share, so that the waiting order must be recomputed."""
        tenant = request.tenant
        self._tenant_running[tenant] += 1
        full = self._tenant_running[tenant] == self._tenant_share.get(tenant, self.max_num_seqs)
        if request.group_id is not None:
            self._call_running[request.group_id] += 1
            call_share = self._call_share.get(tenant, self.max_num_seqs)
            full = full or self._call_running[request.group_id] == call_share
        return full

    def victim(
        self, head: Request, running: Sequence[Request], protect_after_preemptions: int
    ) -> Request | None:
        """The running request to preempt for the waiting ``head`` (within its shares): the
        most recently admitted one of another tenant above its share, or of another call of
        several samples above its share, of the same or worse priority and preempted fewer
        than ``protect_after_preemptions`` times (age protects no running request here: its
        tenant and call keep their shares); None if none."""
        for r in reversed(running):
            if r.priority < head.priority or r.num_preemptions >= protect_after_preemptions:
                continue
            if r.tenant != head.tenant:
                if self._tenant_running[r.tenant] > self._tenant_share.get(r.tenant, 1 << 30):
                    return r
            elif r.group_id is not None and r.group_id != head.group_id:
                call_share = self._call_share.get(r.tenant, self.max_num_seqs)
                if self._call_running[r.group_id] > call_share:
                    return r
        return None
