"""Stop strings over a stream of text deltas.

A stop string may be split over any number of tokens (and so over any number of deltas), so
the checker holds back the end of the text while it could still be the start of a stop
string: the longest suffix of the unreleased text that is a proper prefix of some stop string.
Everything before it is released at once. Released text never takes part in a later match:
a match can only begin inside the held-back part, which is exactly the suffix that could.

When several stop strings occur in the same text, the one that starts first wins (the longest
of those that start at the same place). The output ends before the match, or after it with
``include_in_output``; text after it is dropped (as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopChecker"]


class StopChecker:
    """Matches stop strings in a stream of text deltas.

    Args:
        stop: the stop strings (non-empty).
        include_in_output: release the matched stop string at the end of the text.

    Invariant: ``"".join(released deltas) + flush()`` equals the text fed in, up to the end
    (or the start, without ``include_in_output``) of the first match, or all of it when
    nothing matched.
    """

    __slots__ = ("_held", "_include", "_max_hold", "_stop", "matched")

    def __init__(self, stop: Sequence[str], *, include_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._include = include_in_output
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        #: The stop string that matched, once one has.
        self.matched: str | None = None

    def add(self, delta: str, *, match: bool = True) -> str:
        """Feed new text; return the text that can be released now.

        Args:
            delta: the next piece of text.
            match: look for stop strings (False before ``min_tokens``: text is still held
                back, so that a stop string that starts now but ends after ``min_tokens``
                is found, as vLLM's look-back finds it).

        After a match (:attr:`matched` is set) the returned text ends at the match and
        every later call returns "".
        """
        if self.matched is not None:
            return ""
        text = self._held + delta
        if match:
            best: tuple[int, int, str] | None = None  # (start, -len, string)
            for s in self._stop:
                i = text.find(s)
                if i >= 0 and (best is None or (i, -len(s)) < best[:2]):
                    best = (i, -len(s), s)
            if best is not None:
                start, _, s = best
                self.matched = s
                self._held = ""
                return text[: start + len(s)] if self._include else text[:start]
        hold = self._hold_length(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """Release the held-back text (the request ended without completing a stop string)."""
        text, self._held = self._held, ""
        return text

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[len(text) - k :]
            if any(len(s) > k and s.startswith(tail) for s in self._stop):
                return k
        return 0
