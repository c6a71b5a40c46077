"""Structured outputs (``SamplingParams.structured_outputs``, xgrammar) on the tiny random model.

Random weights are the strongest test: the model knows nothing of JSON, so only the grammar
can make its outputs valid. An output that reaches ``max_tokens`` before its grammar is
complete ends with "length" and is only a prefix; the schemas here have short documents
(enums, bounded strings and arrays) so that most seeds finish with "stop", and every "stop"
output must parse and validate.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
import torch

from asyncllm import InvalidRequestError, SamplingParams, StructuredOutputsParams
from asyncllm.engine.async_engine import AsyncEngine
from tests.conftest import wait_until

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f", "k"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "loc": {
            "type": "object",
            "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "ok": {"type": "boolean"},
            },
            "required": ["lat", "ok"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "unit", "days", "loc"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}(\.[A-Z])?"
CHOICES = ["yes", "no", "maybe so", 'say "hi"\n']
# A tiny arithmetic language: sums of products of 1-2 digit numbers, at most a few terms.
EBNF = """
root ::= expr
expr ::= term (" + " term)?
term ::= num ("*" num)?
num ::= [1-9] [0-9]?
"""
EBNF_RE = re.compile(r"[1-9][0-9]?(\*[1-9][0-9]?)?( \+ [1-9][0-9]?(\*[1-9][0-9]?)?)?")
SEEDS = range(10)


def _params(seed: int, n: int = 1, **so: object) -> SamplingParams:
    return SamplingParams(max_tokens=80, seed=seed, n=n, structured_outputs=so)


def _check_json(text: str) -> None:
    # strict: no raw control character inside a string (RFC 8259), which xgrammar 0.2.9's
    # rule for length-bounded strings allowed (mlc-ai/xgrammar#800; json_string_rules_fixed)
    jsonschema.validate(json.loads(text), SCHEMA)


async def _run(engine: AsyncEngine, params: list[SamplingParams], stream: bool) -> list:
    """Every sample's (text, finish_reason), in call then index order."""

    async def one(p: SamplingParams) -> list[tuple[str, str]]:
        if not stream:
            out = await engine.generate("Answer:", p)
            return [(s.text, s.finish_reason) for s in (out.samples or [out])]
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        async for out in engine.stream("Answer:", p):
            texts[out.index] = texts.get(out.index, "") + out.text
            if out.finished:
                reasons[out.index] = out.finish_reason
        return [(texts[i], reasons[i]) for i in sorted(texts)]

    results = await asyncio.gather(*(one(p) for p in params))
    return [x for r in results for x in r]


def _check_all(results: list, check, min_stop: float = 0.75) -> None:
    stopped = [text for text, reason in results if reason == "stop"]
    assert len(stopped) >= min_stop * len(results), results
    for text in stopped:
        check(text)


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
@pytest.mark.parametrize("stream", [False, True])
async def test_outputs_follow_the_grammar(tiny_llama_dir, make_engine, stream):
    engine = make_engine(tiny_llama_dir)
    kinds = [
        ({"json": SCHEMA, "disable_any_whitespace": True}, _check_json),
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        ({"choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
        ({"grammar": EBNF}, lambda t: EBNF_RE.fullmatch(t) or pytest.fail(t)),
    ]
    async with engine:  # all kinds in one batch
        results = await asyncio.gather(
            *(_run(engine, [_params(s, **so) for s in SEEDS], stream) for so, _ in kinds)
        )
        for (so, check), res in zip(kinds, results, strict=True):
            # choice, regex and the grammar are always complete within 80 tokens
            _check_all(res, check, min_stop=0.75 if "json" in so else 1.0)
        assert len(engine.core.grammar_matchers) == 0
        compiler = engine.core.grammar_compiler
        assert compiler.num_compiled == len(kinds)  # each grammar compiled once
        assert compiler.num_cache_hits == len(kinds) * (len(SEEDS) - 1)


def test_a_repeated_schema_is_compiled_once(tiny_llama_dir, monkeypatch):
    """The compiler's cache: a schema seen before (equal text, another dict object) calls
    xgrammar's compile once; hits are counted and timed apart from compiles (the bench's
    W1J report prints them)."""
    from transformers import AutoTokenizer

    from asyncllm.bench.reporting.markdown import compile_lines
    from asyncllm.structured_output import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    backend = compiler._backend()
    calls = []
    real = backend.compile_grammar

    def spy(self: object, *a: object, **k: object) -> object:
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(type(backend), "compile_grammar", spy)
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    for _ in range(3):
        again = compiler.compile(StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA))))
        assert again is first
    assert len(calls) == 1
    stats = compiler.stats()
    assert (stats["num_compiled"], stats["num_cache_hits"]) == (1, 3)
    assert stats["compile_s"] > 0 and stats["backend_s"] > 0
    (line,) = [x for x in compile_lines(stats) if x]
    assert "1 compile(s)" in line and "3 cache hits" in line


async def test_greedy_and_sampled_rows_in_one_batch_follow_the_grammar(tiny_llama_dir, make_engine):
    """Greedy rows (the sampler checks their argmax against the bitmask and masks only a
    forbidden pick, then takes the argmax again) and sampled rows (masked before sampling)
    in one batch: every output follows its grammar; greedy outputs are the masked argmax,
    so a repeated prompt gives the same text."""
    engine = make_engine(tiny_llama_dir)
    kinds = [
        ({"json": SCHEMA, "disable_any_whitespace": True}, _check_json),
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    ]

    async def one(prompt: str, temperature: float, so: dict) -> tuple[str, str]:
        p = SamplingParams(max_tokens=80, temperature=temperature, seed=7, structured_outputs=so)
        out = await engine.generate(prompt, p)
        return out.text, out.finish_reason

    async with engine:
        for so, check in kinds:
            calls = [one(f"Answer {i}:", 0.0 if i % 2 else 0.8, so) for i in range(12)]
            calls.append(one("Answer 1:", 0.0, so))  # a greedy repeat of row 1
            results = await asyncio.gather(*calls)
            _check_all(results, check, min_stop=0.75 if "json" in so else 1.0)
            assert results[-1] == results[1]
        counts = engine.core.runner.sampler.grammar_rows
        assert counts.checked > 0 and counts.sampled > 0


async def test_json_object_and_any_whitespace(tiny_llama_dir, make_engine):
    """Any whitespace (the default) lets a random model write whitespace until max_tokens
    (finish_reason "length", a valid prefix); "stop" outputs must be valid. json_object:
    any JSON object."""
    engine = make_engine(tiny_llama_dir)
    async with engine:
        loose = [SamplingParams(max_tokens=30, seed=s, structured_outputs={"json": SCHEMA})
                 for s in range(4)]  # fmt: skip
        obj = [_params(s, json_object=True, disable_any_whitespace=True) for s in range(6)]
        loose_res, obj_res = await asyncio.gather(
            _run(engine, loose, False), _run(engine, obj, False)
        )
    for text, reason in loose_res:
        if reason == "stop":
            _check_json(text)
        else:
            assert reason == "length" and text.lstrip().startswith("{")
    for text, reason in obj_res:
        if reason == "stop":
            assert isinstance(json.loads(text, strict=False), dict)
        else:
            assert text.startswith("{")
    assert any(reason == "stop" for _, reason in obj_res)


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
@pytest.mark.parametrize("mode", ["offload", "recompute"])
async def test_preemption_keeps_matcher_state(tiny_llama_dir, make_engine, mode):
    """n=2 samples of 4 seeded calls in a pool for about two of them: every request is
    preempted at some point, yet outputs equal those of a large pool (seeded sampling does
    not depend on the batch) and so stay valid: the matchers survived."""
    kw = dict(block_size=4, max_num_batched_tokens=32, max_model_len=96)
    so = {"json": SCHEMA, "disable_any_whitespace": True}
    params = [_params(s, n=2, **so) for s in range(4)]
    big = make_engine(tiny_llama_dir, kv_cache_bytes=2**21, **kw)
    async with big:
        expected = await _run(big, params, False)
    block_bytes = 4 * 2 * 2 * 2 * 16 * 4
    small = make_engine(tiny_llama_dir, kv_cache_bytes=26 * block_bytes, preemption_mode=mode, **kw)
    async with small:
        got = await _run(small, params, True)
        stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert got == expected
    _check_all(got, _check_json)
    assert len(small.core.grammar_matchers) == 0


#: Strings bounded by length only, where xgrammar 0.2.9 let raw control characters in.
LENGTH_SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"type": "string", "minLength": 2, "maxLength": 4},
        "c": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("text", "ok"),
    [('"ab"', True), ('"a\x01"', False), ('"a\\n"', True), ('"\\u00e9x"', True),
     ('"a\\"b"', True), ('"\\ud83d\\ude00"', False), ('"a"', False), ('"abcde"', False)],
)  # fmt: skip
def test_length_bounded_strings_are_rfc_8259_strings(text, ok):
    """The grammar of a string with minLength 2 and maxLength 4: no raw control character,
    escapes allowed and counted as one character each (a surrogate pair, two escapes for
    one code point, is left out so the bounds hold in code points)."""
    import xgrammar as xgr

    from asyncllm.structured_output import json_string_rules_fixed

    schema = json.dumps({"type": "string", "minLength": 2, "maxLength": 4})
    fixed = json_string_rules_fixed(str(xgr.Grammar.from_json_schema(schema)))
    accepted = xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(fixed), text)
    assert accepted == ok
    if ok:
        assert 2 <= len(json.loads(text)) <= 4


def _strict_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)  # json.loads is strict by default


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_length_bounded_strings_parse_strictly(tiny_llama_dir, make_engine):
    """Sampled outputs under a schema of length-bounded strings: every one parses with a
    strict parser and validates (about 1 in 40 held a raw control character before)."""
    engine = make_engine(tiny_llama_dir)
    params = [
        SamplingParams(max_tokens=80, seed=s, temperature=1.5,
                       structured_outputs={"json": LENGTH_SCHEMA, "disable_any_whitespace": True})
        for s in range(64)
    ]  # fmt: skip
    async with engine:
        results = await _run(engine, params, stream=False)
    _check_all(results, lambda t: _strict_valid(t, LENGTH_SCHEMA))


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_user_stop_token_ids_wait_for_the_grammar(tiny_llama_dir, make_engine):
    """A request's ``stop_token_ids`` hold ordinary tokens (here the vocabulary's words of
    three letters or more that the schema's keys do not need) that the grammar allows
    inside a JSON string: they are masked until the document is complete, so every output
    ends "stop" with valid JSON (they ended it half-written before), and one of them (or
    EOS) may end it there."""
    engine = make_engine(tiny_llama_dir)
    vocab = engine.core.tokenizer.convert_ids_to_tokens(list(range(5000)))
    keys = json.dumps(SCHEMA)
    stops = [
        i for i, t in enumerate(vocab)
        if len(w := t.lstrip("Ġ")) >= 3 and w.isalpha() and w not in keys
    ]  # fmt: skip
    assert len(stops) > 2000
    params = [
        SamplingParams(max_tokens=80, seed=s, temperature=1.0, stop_token_ids=stops,
                       structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
        for s in range(16)
    ]  # fmt: skip
    async with engine:
        results = await _run(engine, params, stream=True)
        assert len(engine.core.grammar_matchers) == 0
    _check_all(results, _check_json)


async def test_grammar_wins_over_min_tokens_and_ignore_eos(tiny_llama_dir, make_engine):
    """A complete grammar allows only EOS: min_tokens and ignore_eos do not make the model
    write past it; the request ends with "stop"."""
    engine = make_engine(tiny_llama_dir)
    async with engine:
        for extra in ({"min_tokens": 10}, {"ignore_eos": True}):
            p = SamplingParams(
                max_tokens=30, seed=1, structured_outputs={"choice": ["ab"]}, **extra
            )
            out = await engine.generate("x", p)
            assert (out.text, out.finish_reason) == ("ab", "stop")


async def test_logprobs_stay_raw(tiny_llama_dir, make_engine):
    """The first token's top alternatives are the unconstrained model's, grammar or not."""
    engine = make_engine(tiny_llama_dir)
    async with engine:
        free = await engine.generate("x", SamplingParams(max_tokens=1, logprobs=5))
        out = await engine.generate(
            "x", SamplingParams(max_tokens=5, logprobs=5, structured_outputs={"choice": ["7"]})
        )
    raw = {t: (lp.rank, lp.logprob) for t, lp in free.logprobs[0].items() if lp.rank <= 5}
    got = {t: (lp.rank, lp.logprob) for t, lp in out.logprobs[0].items() if lp.rank <= 5}
    assert got.keys() == raw.keys() and len(raw) == 5
    for t, (rank, lp) in raw.items():
        assert got[t][0] == rank and got[t][1] == pytest.approx(lp, abs=1e-4)
    # The chosen token "7" is one the grammar allows, with its raw rank (not 1).
    chosen = out.logprobs[0][out.token_ids[0]]
    assert out.text == "7" and chosen.rank > 5


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_stop_string_and_cancel_free_the_matcher(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir)
    core = engine.core
    async with engine:
        p = SamplingParams(max_tokens=40, seed=3, stop=["-"], structured_outputs={"regex": REGEX})
        out = await engine.generate("x", p)
        assert out.finish_reason == "stop" and "-" not in out.text
        assert len(core.grammar_matchers) == 0
        slow = SamplingParams(max_tokens=200, structured_outputs={"regex": "[a-z ]{1,300}"})
        stream = engine.stream("x", slow)
        await stream.__anext__()
        assert len(core.grammar_matchers) == 1
        await stream.aclose()
        await wait_until(lambda: not core.has_unfinished())
        assert len(core.grammar_matchers) == 0


@pytest.mark.parametrize(
    ("so", "field", "reason"),
    [
        ({"json": {"type": "nonsense"}}, "json", "nonsense"),
        ({"json": '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'}, "json", ""),
        ({"regex": "(?=a)b"}, "regex", "Lookahead"),
        ({"regex": r"\bword"}, "regex", "Word boundary"),
        ({"regex": "a["}, "regex", ""),
        ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ],
)
async def test_uncompilable_grammar_fails_only_its_call(
    tiny_llama_dir, make_engine, so, field, reason
):
    engine = make_engine(tiny_llama_dir)
    async with engine:
        with pytest.raises(InvalidRequestError, match=f"structured_outputs.{field}.*{reason}"):
            await engine.generate("x", SamplingParams(structured_outputs=so))
        with pytest.raises(InvalidRequestError, match=f"structured_outputs.{field}"):  # n > 1
            await engine.generate("x", SamplingParams(n=3, structured_outputs=so))
        ok = await engine.generate("x", _params(0, choice=["fine"]))
        assert ok.text == "fine"
        assert engine.health() == "running" and len(engine.core.grammar_matchers) == 0


async def test_no_compile_on_the_loop_or_the_compute_thread(
    tiny_llama_dir, make_engine, monkeypatch
):
    engine = make_engine(tiny_llama_dir)
    compiler = engine.core.grammar_compiler
    threads: list[str] = []
    real = compiler._compile

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(compiler, "_compile", spy)
    async with engine:
        params = [_params(s, n=2, regex=r"\d{3}") for s in range(3)]
        params.append(_params(0, json={"type": "object", "properties": {}}))
        outs = await asyncio.gather(*(engine.generate([5, 6, 7], p) for p in params))
    assert all(o.finish_reason == "stop" for o in outs)
    loop_thread = threading.current_thread().name  # this test's event loop runs here
    assert threads, "no grammar was compiled"
    assert all(t != loop_thread and not t.startswith("asyncllm-step") for t in threads), threads
    with pytest.raises(RuntimeError, match="compute thread"):
        core = engine.core
        core.compute_thread.call(lambda: core.compile_grammar(params[0]))


def test_sync_engine_compiles_at_add_request(tiny_llama_dir):
    """LLMEngine used directly: add_request compiles (cached) and refuses a bad grammar
    before queueing anything."""
    from asyncllm.config import EngineConfig
    from asyncllm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir)))
    try:
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(?<=a)b"))
        with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex"):
            engine.add_request(engine.inputs.make_request("bad", [5, 6], bad))
        assert not engine.has_unfinished() and len(engine.grammar_matchers) == 0
        good = SamplingParams(max_tokens=20, structured_outputs={"choice": ["ok", "fine"]})
        engine.add_request(engine.inputs.make_request("good", [5, 6], good))
        tokens = []
        while engine.has_unfinished():
            for u in engine.step():
                tokens.append(u.token_id)
                reason = u.finish_reason
        assert reason == "stop"
        assert engine.tokenizer.decode(tokens, skip_special_tokens=True) in ("ok", "fine")
        assert len(engine.grammar_matchers) == 0
    finally:
        engine.stop_compute_thread()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (xgrammar's GPU kernel)")
async def test_gpu_bitmask_kernel_and_engine(tiny_llama_dir, make_engine):
    """On a CUDA device the sampler's mask is xgrammar's GPU kernel (Triton or CUDA): it must
    mask exactly what its CPU kernel masks (a subset of rows, a vocabulary that is not a
    multiple of 32), and constrained greedy and sampled outputs of the engine on the GPU
    must follow their grammar. Skipped without CUDA only (a GPU machine runs it)."""
    from asyncllm.structured_output import apply_token_bitmask

    g = torch.Generator().manual_seed(0)
    rows, vocab = 8, 1000
    logits = torch.randn(rows, vocab, generator=g)
    allowed = torch.rand(rows, (vocab + 31) // 32 * 32, generator=g) < 0.3
    words = (allowed.view(rows, -1, 32).long() << torch.arange(32)).sum(-1).to(torch.int32)
    masked = [0, 2, 3, 7]
    cpu = logits.clone()
    apply_token_bitmask(cpu, words, masked)
    gpu = logits.cuda()
    apply_token_bitmask(gpu, words, masked)
    assert torch.equal(gpu.cpu(), cpu)
    expect = logits.clone()
    expect[masked] = expect[masked].masked_fill(~allowed[masked, :vocab], float("-inf"))
    assert torch.equal(cpu, expect)

    engine = make_engine(tiny_llama_dir, device="cuda")
    async with engine:
        outs = await asyncio.gather(
            *(
                engine.generate(
                    f"Answer {i}:",
                    SamplingParams(
                        max_tokens=80,
                        temperature=0.0 if i % 2 else 0.8,
                        seed=i,
                        structured_outputs={"json": SCHEMA, "disable_any_whitespace": True},
                    ),
                )
                for i in range(8)
            )
        )
    _check_all([(o.text, o.finish_reason) for o in outs], _check_json)
