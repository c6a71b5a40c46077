"""The batched sampler on hand-made logits: penalties, bias, min_tokens, min-p, logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from asyncllm import SamplingParams
from asyncllm.worker.sampling.batch import SamplingBatch
from asyncllm.worker.sampling.logits_processors import apply_penalties
from asyncllm.worker.sampling.logprobs import compute_logprobs
from asyncllm.worker.sampling.pick import row_argmax, top_k_top_p
from asyncllm.worker.sampling.sampler import Sampler

CPU = torch.device("cpu")


def _chunk(params, prompt=(1,), output=(), stop=frozenset({4}), rid="r"):
    return SimpleNamespace(
        request_id=rid,
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        num_output_tokens=len(output),
        stop_token_ids=stop,
    )


def _batch(*chunks):
    return SamplingBatch.from_chunks(list(chunks), CPU)


def test_penalties_hand_computed():
    """l = [2, -1, 0.5, 0, 3]; prompt [1]; output [0, 0, 2]; r = 2, f = 0.5, p = 0.25.

    repetition on {0, 1, 2}:  [2/2, -1*2, 0.5/2, 0, 3]          = [1, -2, 0.25, 0, 3]
    frequency (c0=2, c2=1):   [1 - 2*0.5, -2, 0.25 - 0.5, 0, 3] = [0, -2, -0.25, 0, 3]
    presence on {0, 2}:       [0 - 0.25, -2, -0.25 - 0.25, 0, 3]
    """
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    batch = _batch(_chunk(params, prompt=[1], output=[0, 0, 2]))
    out = apply_penalties(logits, batch)
    assert out.tolist() == [[-0.25, -2.0, -0.5, 0.0, 3.0]]


def test_penalties_leave_other_rows_alone_and_change_greedy():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0], [5.0, 4.0, 0.0, 0.0, 0.0]])
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    batch = _batch(_chunk(plain, output=[0, 0]), _chunk(penalized, output=[0, 0]))
    assert apply_penalties(logits, batch)[0].tolist() == logits[0].tolist()
    tokens = Sampler(0, CPU)(logits, batch).token_ids.tolist()
    assert tokens == [0, 1]  # 5 - 2*2 = 1 < 4: the penalized row picks token 1


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    seqs = [[1, 5, 7], [2, 2, 9, 40], [49, 0, 3, 3, 3]]
    rows = []
    expected = []
    for i, seq in enumerate(seqs):
        params = SamplingParams(repetition_penalty=1.3 + 0.2 * i)
        rows.append(_chunk(params, prompt=seq[:2], output=seq[2:]))
        proc = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        expected.append(proc(torch.tensor([seq]), logits[i : i + 1].clone())[0])
    out = apply_penalties(logits, _batch(*rows))
    torch.testing.assert_close(out, torch.stack(expected))


def test_logit_bias_forces_and_bans():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    params = [
        SamplingParams(temperature=1.0, logit_bias={7: 100}),
        SamplingParams(temperature=1.0, seed=3, logit_bias={"12": 100.0}),
        SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100}),
        SamplingParams(temperature=0.0),
    ]
    batch = _batch(*(_chunk(p) for p in params))
    tokens = Sampler(0, CPU)(logits, batch).token_ids.tolist()
    assert tokens[0] == 7 and tokens[1] == 12
    assert tokens[2] == int(logits[2].topk(2).indices[1])  # the argmax was banned
    assert tokens[3] == int(logits[3].argmax())


def test_top_k_1_and_temperature_0_are_greedy_whatever_the_seed():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 100, generator=g)
    params = [
        SamplingParams(temperature=1.5, top_k=1, seed=1),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(temperature=0.0, seed=6, top_p=0.3, min_p=0.2),
        SamplingParams(temperature=1e-6, seed=7),
        SamplingParams(temperature=0.0),
    ]
    batch = _batch(*(_chunk(p) for p in params))
    for seed in range(3):
        tokens = Sampler(seed, CPU)(logits, batch).token_ids
        assert tokens.tolist() == logits.argmax(-1).tolist()


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 10.0  # the stop token is by far the most likely
    logits[:, 6] = 5.0
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10)
    young = _chunk(params, output=[1, 1], stop=frozenset({4, 9}))  # 2 generated < 3
    grown = _chunk(params, output=[1, 1, 1], stop=frozenset({4, 9}))  # 3 generated
    tokens = Sampler(0, CPU)(logits, _batch(young, grown)).token_ids.tolist()
    assert tokens == [6, 4]


def test_min_p_keeps_only_tokens_near_the_top():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    params = SamplingParams(temperature=1.0, min_p=0.5)  # keep p >= 0.25: tokens 0 and 1
    batch = _batch(*(_chunk(params) for _ in range(400)))
    tokens = Sampler(0, CPU)(logits, batch).token_ids
    assert set(tokens.tolist()) == {0, 1}
    assert 0.5 < (tokens == 0).float().mean() < 0.75  # 0.5 / 0.8 = 0.625 renormalised


def test_top_p_and_top_k_cut_the_tail():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(300, 1)
    top_p = _batch(*(_chunk(SamplingParams(top_p=0.6)) for _ in range(300)))
    top_k = _batch(*(_chunk(SamplingParams(top_k=3)) for _ in range(300)))
    assert set(Sampler(0, CPU)(logits, top_p).token_ids.tolist()) == {0, 1}
    assert set(Sampler(0, CPU)(logits, top_k).token_ids.tolist()) == {0, 1, 2}


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 64, generator=g)
    params = [
        SamplingParams(temperature=0.9, seed=11, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=1.2, seed=12, min_p=0.05, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.8, top_k=10, presence_penalty=0.5),
    ]
    chunks = [_chunk(p, output=[3, 5]) for p in params]
    together = Sampler(0, CPU)(logits, _batch(*chunks)).token_ids.tolist()
    for i in (0, 2, 3):  # seeded or greedy rows: the same alone as in the batch
        alone = Sampler(99, CPU)(logits[i : i + 1], _batch(chunks[i])).token_ids.tolist()
        assert alone == [together[i]]


def test_logprobs_are_raw_log_softmax_with_ranks():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 20, generator=g)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=2.0, logprobs=0, logit_bias={5: 100}),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler(0, CPU)(logits, _batch(*(_chunk(p, output=[1]) for p in params)))
    assert out.logprobs is not None
    ref = torch.log_softmax(logits, dim=-1)
    tokens = out.token_ids
    assert tokens[1] == 5
    torch.testing.assert_close(out.logprobs.token_logprobs, ref.gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(out.logprobs.top_logprobs, ref.topk(3).values)
    assert out.logprobs.top_ids.tolist() == ref.topk(3).indices.tolist()
    rank_of_5 = int((ref[1] >= ref[1, 5]).sum())
    assert out.logprobs.token_ranks[1] == rank_of_5


def test_compute_logprobs_zero_alternatives():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    lp = compute_logprobs(logits, torch.tensor([0]), 0)
    assert lp.top_ids.shape == (1, 0)
    assert lp.token_ranks.tolist() == [3]
    assert lp.to_lists([0]) == [
        (pytest.approx(float(torch.log_softmax(logits, -1)[0, 0])), 3, [], [])
    ]


def _top_k_top_p_by_full_sort(scaled, top_k, top_p):
    """The textbook version: sort every row, cut top-k, renormalise, cut top-p."""
    out = scaled.clone()
    vocab = scaled.shape[-1]
    for r in range(scaled.shape[0]):
        vals = scaled[r].sort(descending=True).values
        k = int(top_k[r]) or vocab
        probs = vals.masked_fill(torch.arange(vocab) >= k, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs
        keep = torch.arange(vocab) < k
        if top_p[r] < 1:
            keep &= before < top_p[r]
        out[r][scaled[r] < vals[int(keep.sum()) - 1]] = float("-inf")
    return out


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_on_candidates_equals_a_full_sort(seed):
    """Peaked rows are decided among the candidates; flat ones fall back to a full sort."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 12, 3000
    scale = torch.tensor([8.0, 3.0, 1.0, 0.05] * 3)[:, None]
    scaled = torch.randn(rows, vocab, generator=g) * scale
    top_k = torch.tensor([0, 0, 0, 0, 5, 300, 2999, 3000, 0, 1, 40, 0])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 1.0, 0.8, 0.99, 0.3, 1.0, 0.7, 0.9, 0.999])
    got = top_k_top_p(scaled, top_k, top_p)
    want = _top_k_top_p_by_full_sort(scaled, top_k, top_p)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], scaled[~got.isinf()])


def test_request_tensors_are_built_once_per_request(tiny_llama_dir, monkeypatch):
    """A request's logit_bias and stop token ids (up to a vocabulary each) become tensors
    once per request, not at every step: 64 samples with a full-vocabulary logit_bias spent
    5 s per step converting them, stalling every stream."""
    from asyncllm.config import EngineConfig
    from asyncllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=8))
    big: list[int] = []  # sizes of the large lists turned into tensors
    real = torch.tensor

    def spy(data, *args, **kw):
        if isinstance(data, (list, tuple)) and len(data) >= 5000:
            big.append(len(data))
        return real(data, *args, **kw)

    monkeypatch.setattr(torch, "tensor", spy)
    bias = {t: 0.5 for t in range(10_000)}
    stops = list(range(20_000, 30_000))
    params = SamplingParams(
        max_tokens=6, min_tokens=6, temperature=1.0, ignore_eos=True, n=4,
        logit_bias=bias, stop_token_ids=stops,
    )  # fmt: skip
    engine.add_parallel_requests(engine.inputs.make_requests("r", [5, 6, 7, 8], params))
    while engine.has_unfinished():
        engine.step()
    engine.stop_compute_thread()
    # per sample: the bias ids and values, the sorted stop ids -- whatever the step count
    assert big == [10_000] * 12


def test_request_tensors_cache_evicts_least_recently_used():
    from asyncllm.worker.sampling.batch import RequestTensors

    cache = RequestTensors(max_elements=10)
    a, b, c = {1: 1.0}, {2: 2.0}, {3: 3.0}
    built: list[int] = []

    def build(n):
        def make():
            built.append(n)
            return (torch.zeros(4),)

        return make

    cpu = torch.device("cpu")
    cache.get(a, "x", cpu, build(1))
    cache.get(b, "x", cpu, build(2))
    cache.get(a, "x", cpu, build(1))  # hit: a is now the most recent
    cache.get(c, "x", cpu, build(3))  # 12 elements > 10: b goes
    cache.get(a, "x", cpu, build(1))
    cache.get(b, "x", cpu, build(2))
    assert built == [1, 2, 3, 2]


def test_grammar_mask_skips_greedy_rows_whose_best_token_is_allowed(monkeypatch):
    """A greedy row whose argmax the grammar allows keeps that token unmasked (the mask costs
    ~10 ms per [64, 49152] batch on one thread); every other constrained row is masked, and
    every token is the one masking all rows would give (greedy) or an allowed one."""
    from asyncllm import structured_output

    torch.manual_seed(0)
    v = 100
    logits = torch.randn(6, v)
    best = logits.argmax(-1)
    allowed = torch.rand(6, v) < 0.5
    allowed[[0, 2, 4], best[[0, 2, 4]]] = True  # greedy rows 0, 2: best allowed
    allowed[[1, 3, 5], best[[1, 3, 5]]] = False  # greedy rows 1, 3: best forbidden
    words = torch.zeros(6, 4, dtype=torch.int64)
    for t in range(v):
        words[:, t >> 5] |= allowed[:, t].long() << (t & 31)
    bitmask = words.to(torch.int32)  # two's complement wrap, as xgrammar stores it
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)
    params = [greedy, greedy, greedy, greedy, hot, hot]
    chunks = [_chunk(p, rid=f"r{i}") for i, p in enumerate(params)]
    batch = SamplingBatch.from_chunks(chunks, CPU, (bitmask, list(range(6))))
    masked: list[list[int]] = []
    real = structured_output.apply_token_bitmask

    def spy(lg, bm, rows):
        masked.append(list(rows))
        real(lg, bm, rows)

    monkeypatch.setattr(structured_output, "apply_token_bitmask", spy)
    tokens = Sampler(0, CPU)(logits.clone(), batch).token_ids.tolist()
    assert masked == [[4, 5], [1, 3]]  # the sampled rows first, then the forbidden picks
    assert all(allowed[r, t] for r, t in enumerate(tokens))
    reference = logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    assert tokens[:4] == reference[:4]


def test_grammar_checks_every_greedy_pick_at_every_step(monkeypatch):
    """Every step, each greedy constrained row is checked and only a forbidden pick is
    masked (and its argmax taken again), however often that row was forbidden before; a
    sampled row is masked before its draw, every step. Tokens are the masked argmax (greedy)
    or allowed (sampled); the counters count the rows."""
    from asyncllm import structured_output

    torch.manual_seed(1)
    logits = torch.randn(5, 64)
    allowed = torch.zeros(5, 64, dtype=torch.bool)
    allowed[:, 40:] = True
    best = logits.argmax(-1)
    allowed[torch.arange(5), best] = torch.tensor([False, True, True, True, False])
    words = torch.zeros(5, 2, dtype=torch.int64)
    for t in range(64):
        words[:, t >> 5] |= allowed[:, t].long() << (t & 31)
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=1.0, seed=3)]
    chunks = [_chunk(p, rid=f"r{i}") for i, p in enumerate(params)]
    calls: list[list[int]] = []
    real = structured_output.apply_token_bitmask
    monkeypatch.setattr(
        structured_output, "apply_token_bitmask", lambda *a: (calls.append(a[2]), real(*a))
    )
    sampler = Sampler(0, CPU)
    expected = logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    batch = SamplingBatch.from_chunks(chunks, CPU, (words.to(torch.int32), list(range(5))))
    for n in range(1, 4):
        out = sampler(logits.clone(), batch).token_ids.tolist()
        assert out[:4] == expected[:4] and allowed[4, out[4]]
        assert calls[-2:] == [[4], [0]]  # the sampled row, then the one forbidden pick
        assert vars(sampler.grammar_rows) == {"sampled": n, "checked": 4 * n, "forbidden": n}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([7, 256, 1000, 2048, 3072, 5000]),
    ties=st.integers(0, 3),
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=3),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
)
def test_row_argmax_equals_torch_argmax(rows, vocab, ties, specials, seed, bf16):
    """Chunked argmax gives torch's indices: the first maximum, the first NaN, ties across
    and within chunks, rows of -inf; on bfloat16 logits (the greedy sampler's raw logits)
    the same indices as on their float32 copy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g).round(decimals=1)  # coarse values: many ties
    for _ in range(ties):
        r, c = (
            torch.randint(rows, (1,), generator=g).item(),
            torch.randint(vocab, (1,), generator=g).item(),
        )
        x[r, c] = x[r].max()
    for k, v in enumerate(specials):
        x[k % rows, (k * 977) % vocab] = float(v)
    if rows > 1 and seed % 5 == 0:
        x[1] = float("-inf")
    if bf16:
        x = x.bfloat16()
        assert torch.equal(row_argmax(x), x.float().argmax(dim=-1))
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
