"""Parallel sampling (n > 1) in the scheduler: the samples of one call share its prompt.

The scheduler calls one :class:`SampleGroups` at a few hooks; everything specific to calls
of several samples lives here (see :mod:`asyncllm.core.scheduler`'s docstring for the
policy):

* :meth:`~SampleGroups.split` (queueing): a hidden prefix request computes the prompt but
  its last token; the samples wait for it, holding no blocks.
* :meth:`~SampleGroups.fork` (a prefix is computed): each sample shares the prefix's blocks
  (reference counts, no copies) and joins the waiting queue.
* :meth:`~SampleGroups.discard` (an abort): a sample that has not forked yet leaves its
  group; the last one out takes the prefix with it.

Fairness between calls (a call's share of the running slots) is in
:mod:`asyncllm.core.fair_share`.

Pure Python, as the rest of the core.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

from asyncllm.core.block_manager import BlockManager
from asyncllm.core.request import SAMPLE_ID_SEP, Request

__all__ = ["SampleGroups"]


class SampleGroups:
    """The scheduler's parallel-sampling state."""

    def __init__(self) -> None:
        # Prefix request id -> the samples waiting for it to finish before they fork.
        self._forks: dict[str, list[Request]] = {}

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
            tenant=first.tenant,
            deadline=first.deadline,
        )

    @property
    def num_unforked(self) -> int:
        """Samples waiting for their prefix (they count as waiting)."""
        return sum(len(s) for s in self._forks.values())

    def unforked(self) -> Iterable[tuple[str, list[Request]]]:
        """(prefix request id, the samples waiting for it) pairs."""
        return self._forks.items()

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
