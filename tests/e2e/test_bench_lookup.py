"""The llama.cpp peer's prompt-lookup loop (``LlamaCppWorker.run_lookup``) on a scripted
model: the tokens equal plain greedy decoding's, the KV cells stay those of the accepted
tokens, and the counters add up. No llama.cpp here: ``llama_decode`` and the memory calls are
stand-ins, the proposer is prompt lookup over the same tokens."""

from __future__ import annotations

import types

import numpy as np
import pytest

from asyncllm.bench.engine_protocol import Unsupported
from asyncllm.bench.llamacpp_worker import LlamaCppWorker


def _next(tok: int, pos: int) -> int:
    """The scripted model's greedy token after ``tok`` at ``pos``: mostly a cycle of 7 (so
    lookups succeed), with a change every 11 positions (so some are rejected)."""
    return (tok + 1) % 7 + (10 if pos % 11 == 0 else 0)


class _Lookup:
    """Proposes up to ``k`` tokens that followed the latest earlier occurrence of the last
    token (llama-cpp-python's proposer does the same over 2- and 1-grams)."""

    max_ngram_size = 1

    def __init__(self, k: int) -> None:
        self.num_pred_tokens = k

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        last = ids[-1]
        for i in range(len(ids) - 2, -1, -1):
            if ids[i] == last:
                return ids[i + 1 : i + 1 + self.num_pred_tokens]
        return np.array([], dtype=np.intc)


def _worker(k: int) -> tuple[LlamaCppWorker, set[int]]:
    cells: set[int] = set()
    w = object.__new__(LlamaCppWorker)

    def decode(items):
        for seq, pos, _tok, _ in items:
            assert seq == 0 and pos not in cells and all(p in cells for p in range(pos))
            cells.add(pos)
        return np.array([_next(tok, pos) for _, pos, tok, want in items if want])

    def seq_rm(mem, seq, p0, p1):
        assert seq == 0 and p1 == -1
        cells.difference_update({p for p in cells if p >= p0})

    w.ll = types.SimpleNamespace(llama_get_memory=lambda ctx: None, llama_memory_seq_rm=seq_rm)
    w.np, w.ctx, w.settings, w.draft = np, None, {}, _Lookup(k)
    w.context = lambda n_seq, per_seq: None  # type: ignore[method-assign]
    w.decode = decode  # type: ignore[method-assign]
    return w, cells


@pytest.mark.parametrize("k", [1, 4, 10])
@pytest.mark.parametrize("max_tokens", [1, 2, 57])
def test_lookup_decoding_equals_greedy(k: int, max_tokens: int) -> None:
    prompt = [3, 4, 5, 6, 0, 1, 2, 3, 4]
    w, cells = _worker(k)
    res = w.run({"requests": [[prompt, max_tokens, 0.0]], "outputs": True})
    greedy, tok = [], prompt[-1]
    for pos in range(len(prompt) - 1, len(prompt) - 1 + max_tokens):
        tok = _next(tok, pos)
        greedy.append(tok)
    assert res["outputs"] == [greedy]
    # The cache holds the prompt and every accepted token but the last (not yet fed).
    assert cells == set(range(len(prompt) + max_tokens - 1))
    st = res["stats"]
    assert st["spec_num_accepted_tokens"] <= st["spec_num_draft_tokens"]
    # Each verification yields its accepted proposals plus one token.
    assert st["spec_num_steps"] + st["spec_num_accepted_tokens"] == max_tokens - 1
    if max_tokens == 57:
        assert 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"]
    assert f"num_pred_tokens={k}" in res["settings"]["speculation"]


def test_lookup_decoding_runs_one_stream_only() -> None:
    w, _ = _worker(4)
    with pytest.raises(Unsupported, match="one stream"):
        w.run({"requests": [[[1, 2], 4, 0.0], [[3, 4], 4, 0.0]]})
