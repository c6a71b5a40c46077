"""What every benchmark engine worker shares (:mod:`asyncllm.bench.engine_process` and the
peers' workers): a run's timeline, the skip signal, resident memory and percentiles.

Standard library only: the peers' virtual environments (vLLM, llama.cpp) import it beside
``engine_process.py`` by path, without asyncllm installed.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from typing import Any


def rss_mb(pids: Sequence[int] = ()) -> float:
    """Resident memory (MiB) of this process plus ``pids`` (children, e.g. vLLM's engine)."""
    total = 0.0
    for pid in (os.getpid(), *pids):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
        except OSError:
            pass
    if total == 0.0:  # no /proc: peak RSS of this process
        total = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return total


def child_pids() -> list[int]:
    """Every descendant of this process (Linux /proc), for the RSS of multi-process peers."""
    kids: dict[int, list[int]] = {}
    try:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    except OSError:
        return []
    out: list[int] = []
    todo = [os.getpid()]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` (0..100) percentile, linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Timeline:
    """Per-request submission / first token / last token times and received tokens."""

    def __init__(self, n: int) -> None:
        self.submit = [0.0] * n
        self.first: list[float | None] = [None] * n
        self.last: list[float | None] = [None] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.cached: list[int | None] = [None] * n

    def got(self, i: int, ids: Sequence[int], t: float) -> None:
        if not ids:
            return
        if self.first[i] is None:
            self.first[i] = t
        self.last[i] = t
        self.tokens[i].extend(ids)

    def result(self, start: float, keep_outputs: bool) -> dict[str, Any]:
        """Wall time, tokens and per-request TTFT / TPOT / end-to-end latency."""
        ends = [t for t in self.last if t is not None]
        wall = (max(ends) if ends else time.perf_counter()) - start
        ttft, tpot, e2e = [], [], []
        for i, toks in enumerate(self.tokens):
            f, la = self.first[i], self.last[i]
            if f is None or la is None:
                continue
            ttft.append(f - self.submit[i])
            e2e.append(la - self.submit[i])
            if len(toks) > 1:
                tpot.append((la - f) / (len(toks) - 1))
        return {
            "wall_s": wall,
            "generated_tokens": sum(len(t) for t in self.tokens),
            "completed": sum(1 for t in self.last if t is not None),
            "ttft_s": ttft,
            "tpot_s": tpot,
            "e2e_s": e2e,
            "outputs": self.tokens if keep_outputs else None,
            "cached_tokens": self.cached,
        }


class Unsupported(Exception):
    """The engine cannot run this workload (reported as skipped, with the reason)."""
