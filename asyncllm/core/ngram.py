"""N-gram (prompt lookup) proposals for model-free speculative decoding.

Prompt lookup decoding (Saxena, 2023; vLLM's ``ngram`` speculator): the last ``n`` tokens of
a request are looked up among its earlier tokens (prompt and output), longest ``n`` first,
and the tokens that followed their most recent earlier occurrence are proposed as the next
ones. Output that repeats its context (a document being quoted or edited, code, the answer's
own phrases) is proposed correctly and verified by the model in one step.

Pure Python: the index is one dict per n-gram size, from the n-gram (a tuple of token ids)
to the end position of its most recent occurrence, extended by one entry per size per new
token (no rescan of the history).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramIndex"]


class NgramIndex:
    """The n-grams of one token sequence, kept as the sequence grows.

    Args:
        min_n: the shortest n-gram looked up (tokens, >= 1).
        max_n: the longest (>= ``min_n``).

    Raises:
        ValueError: sizes out of range.
    """

    __slots__ = ("_last", "max_n", "min_n", "tokens")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # Per size n (index n - min_n): n-gram -> end position (exclusive) of its most recent
        # occurrence that ends before len(tokens), so the current suffix never finds itself.
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens; each adds at most one n-gram per size to the index."""
        tokens = self.tokens
        for t in token_ids:
            end = len(tokens)  # the suffix ending here becomes an "earlier" occurrence
            for i, table in enumerate(self._last):
                n = self.min_n + i
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
            tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        suffix (``max_n`` down to ``min_n`` tokens) found; [] when none is found."""
        tokens = self.tokens
        size = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self._last[n - self.min_n].get(tuple(tokens[size - n :]))
            if end is not None:
                return tokens[end : min(end + k, size)]
        return []
