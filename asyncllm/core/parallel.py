"""Parallel sampling (n > 1) in the scheduler: prompt sharing and fairness between calls.

The scheduler calls one :class:`SampleGroups` at a few hooks; everything specific to calls
of several samples lives here (see :mod:`asyncllm.core.scheduler`'s docstring for the
policy):

* :meth:`~SampleGroups.split` (queueing): a hidden prefix request computes the prompt but
  its last token; the samples wait for it, holding no blocks.
* :meth:`~SampleGroups.fork` (a prefix is computed): each sample shares the prefix's blocks
  (reference counts, no copies) and joins the waiting queue.
* :meth:`~SampleGroups.discard` (an abort): a sample that has not forked yet leaves its
  group; the last one out takes the prefix with it.
* :meth:`~SampleGroups.refresh`, :meth:`~SampleGroups.over_share`,
  :meth:`~SampleGroups.admitted` and :meth:`~SampleGroups.fairness_victim`: the running
  slots of each call (``group_id``) against its fair share ``max(1, max_num_seqs // calls)``.

Pure Python, as the rest of the core.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import SAMPLE_ID_SEP, Request, RequestStatus

__all__ = ["SampleGroups"]


class SampleGroups:
    """The scheduler's parallel-sampling state.

    Args:
        max_num_seqs: the most requests running at once (shared fairly between calls).
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        # Prefix request id -> the samples waiting for it to finish before they fork.
        self._forks: dict[str, list[Request]] = {}
        # Running requests per call of several samples, and the fair share (refresh()).
        self._running: Counter[str] = Counter()
        self._fair_share = max_num_seqs

    # ------------------------------------------------------------------ prompt sharing

    def split(self, samples: Sequence[Request], known: Container[str]) -> Request | None:
        """The prefix request that computes the samples' shared prompt, the samples kept to
        :meth:`fork` from it; None when there is nothing to share (one sample, or a prompt
        of one token): the caller queues the samples as plain requests.

        Args:
            samples: the samples of one call; the prompt is the first one's.
            known: the ids of the requests already in the scheduler.

        Raises:
            ValueError: a duplicate request id (among the samples, or already known).
        """
        first = samples[0]
        if len(samples) == 1 or len(first.prompt_token_ids) < 2:
            return None
        ids = [r.request_id for r in samples]
        prefix_id = f"{first.request_id}{SAMPLE_ID_SEP}prefix"
        if len(set(ids)) != len(ids) or any(i in known for i in [*ids, prefix_id]):
            raise ValueError(f"duplicate request id among {ids}")
        self._forks[prefix_id] = list(samples)
        return Request(
            prefix_id,
            first.prompt_token_ids[:-1],
            max_tokens=1,
            max_model_len=first.max_model_len,
            arrival_time=first.arrival_time,
            priority=first.priority,
            cache_salt=first.cache_salt,
            prefill_only=True,
            group_id=first.group_id,
        )

    @property
    def num_unforked(self) -> int:
        """Samples waiting for their prefix (they count as waiting)."""
        return sum(len(s) for s in self._forks.values())

    def discard(self, request: Request) -> tuple[bool, str | None]:
        """Take a request that ends before it forked out of its group.

        Returns:
            (whether it was such a sample, holding no blocks and in no queue; the id of its
            prefix request, to abort, when it was the last sample waiting for it).
        """
        for prefix_id, samples in self._forks.items():
            if request in samples:
                samples.remove(request)
                if not samples:
                    del self._forks[prefix_id]
                    return True, prefix_id
                return True, None
        return False, None

    def fork(self, prefix: Request, block_manager: BlockManager) -> list[Request]:
        """The prefix is computed: its samples share its blocks, computed up to where it
        stopped; returns them, for the waiting queue."""
        samples = self._forks.pop(prefix.request_id, [])
        for r in samples:
            block_manager.fork(prefix.request_id, r.request_id)
            r.num_computed_tokens = prefix.num_computed_tokens
            r.num_cached_tokens = prefix.num_cached_tokens
            r.admitted = True  # its prefix was (and counted its prompt)
        return samples

    # ------------------------------------------------------------------ fairness

    def refresh(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Count the running requests of each call with parallel samples, and the fair share
        of running slots per call that wants one."""
        self._running = Counter(r.group_id for r in running if r.group_id)
        if not self._running:  # no call of several samples runs: nobody is above
            self._fair_share = self.max_num_seqs
            return
        calls = {r.group_id or r.request_id for r in running}
        calls.update(r.group_id or r.request_id for r in waiting)
        self._fair_share = max(1, self.max_num_seqs // len(calls))

    @property
    def any_running(self) -> bool:
        """A call of several samples has running requests (as of the last refresh)."""
        return bool(self._running)

    def over_share(self, request: Request) -> bool:
        """Whether the request's call holds (or, once it is admitted, would hold) more than
        its fair share of running slots."""
        if request.group_id is None:
            return False
        held = self._running[request.group_id]
        return held + (request.status is not RequestStatus.RUNNING) > self._fair_share

    def admitted(self, request: Request) -> bool:
        """Count a newly admitted request; True when its call just reached its share, so
        that its other waiting samples now sort behind the other calls' requests."""
        if request.group_id is None:
            return False
        self._running[request.group_id] += 1
        return self._running[request.group_id] == self._fair_share

    def fairness_victim(
        self, head: Request, running: Sequence[Request], protect_after_preemptions: int
    ) -> Request | None:
        """The running sample to preempt for the waiting ``head`` (within its call's share):
        the most recently admitted sample of another call above its share, of the same or
        worse priority and preempted fewer than ``protect_after_preemptions`` times (age
        protects no running sample here: its call keeps its fair share); None if none."""
        victims = [
            r for r in running
            if r.group_id is not None and r.group_id != head.group_id
            and r.priority >= head.priority and self.over_share(r)
            and r.num_preemptions < protect_after_preemptions
        ]  # fmt: skip
        return victims[-1] if victims else None
