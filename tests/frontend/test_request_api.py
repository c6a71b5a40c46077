"""The request API end to end on the tiny models: parameters, stop conditions, chat, logprobs,
metrics, overload, timeouts, aborts, engine failure, shutdown and the synchronous facade.

Every async test runs on asyncio and on trio (anyio's pytest plugin)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
import time

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncllm import (
    LLM,
    AsyncLLMError,
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    QueueFull,
    SamplingParams,
)
from asyncllm.engine.async_engine import collect
from tests.conftest import (
    BOTH_BACKENDS,
    check_pool_whole,
    gather,
    script_output,
    spawn,
    wait_until,
)


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request):
    return request.param


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SMALL = dict(block_size=4, kv_cache_bytes=2**20)
#: For tests that compare with a float32 transformers reference value for value (the others
#: run the default dtype, bfloat16 where the CPU has it).
F32 = dict(SMALL, dtype="float32")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in [3, 7, 12, 20, 1, 9]]


def _hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _reference(model, prompts, max_new_tokens, **kw):
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def _script(engine, text):
    return script_output(engine, text, end_with_eos=False)


async def _items(gen):
    return [out async for out in gen]


# --------------------------------------------------------------------------- parameters


async def test_logprobs_match_a_reference_forward(tiny_llama_dir, make_engine):
    """Raw log-softmax values of generated and prompt tokens, with chunked prefill."""
    prompt = _prompts()[3]  # 20 tokens over 3 steps of budget 8
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=8, **F32)
    greedy = SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    forced = SamplingParams(max_tokens=3, temperature=1.0, logit_bias={77: 100}, logprobs=0)
    async with engine:
        out = await engine.generate(prompt, greedy)
        biased = await engine.generate(prompt, forced)
    model = _hf(tiny_llama_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)

    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        row = ref[j - 1]
        assert next(iter(entry)) == prompt[j]
        assert entry[prompt[j]].logprob == pytest.approx(float(row[prompt[j]]), abs=1e-4)
        assert entry[prompt[j]].rank == int((row >= row[prompt[j]]).sum())
        top = row.topk(2)
        assert [t for t in entry if t != prompt[j]] == [
            t for t in top.indices.tolist() if t != prompt[j]
        ]
    assert len(out.logprobs) == len(out.token_ids) == 5
    for i, tok in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + i]
        entry = out.logprobs[i]
        assert next(iter(entry)) == tok and entry[tok].rank == 1  # greedy: the argmax
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        top = row.topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        assert entry[tok].decoded_token == engine.tokenizer.decode([tok])
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids, strict=True))
    )
    # Raw means before bias: the forced token keeps its (low) model logprob.
    assert biased.token_ids == [77, 77, 77]
    assert biased.logprobs[0][77].logprob == pytest.approx(
        float(ref[len(prompt) - 1, 77]), abs=1e-4
    )
    assert biased.logprobs[0][77].rank > 1 and len(biased.logprobs[0]) == 1


async def test_logprobs_token_bytes(tiny_llama_dir, make_engine):
    """A token that holds part of a character (SmolLM2's 177 = byte 0xE6) has its own byte,
    not U+FFFD's; a whole token's bytes are its text's UTF-8."""
    engine = make_engine(tiny_llama_dir, **SMALL)
    forced = SamplingParams(max_tokens=1, logit_bias={177: 100}, logprobs=1)
    async with engine:
        part = await engine.generate("Hello", forced)
        whole = await engine.generate("Hello", SamplingParams(max_tokens=3, logprobs=3))
    assert part.token_ids == [177]
    lp = part.logprobs[0][177]
    assert lp.token_bytes == b"\xe6" and lp.decoded_token == "\ufffd"
    for position in whole.logprobs:
        for tid, lp in position.items():
            assert lp.token_bytes == engine.tokenizer.decode([tid]).encode() or (
                "\ufffd" in lp.decoded_token
            )


async def test_rendered_chat_text_gets_one_bos(bos_llama_dir, make_engine):
    """A Llama-2 style tokenizer adds BOS, and its chat template writes one: the rendered
    template as a text prompt, and engine.chat, start with one BOS, not two."""
    engine = make_engine(bos_llama_dir, **SMALL)
    tok = engine.tokenizer
    bos = tok.bos_token_id
    assert tok.encode("Hi")[0] == bos  # the tokenizer adds BOS
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith(tok.bos_token) and tok.encode(text)[:2] == [bos, bos]
    one = SamplingParams(max_tokens=1)
    async with engine:
        rendered = await engine.generate(text, one)
        chat = await collect(engine.chat(msgs, one), "delta")
        as_dict = await engine.generate({"prompt": text}, one)
        plain = await engine.generate("Hi", one)
        ids = await engine.generate([bos, bos, *tok.encode("Hi")[1:]], one)
    assert rendered.prompt_token_ids == chat.prompt_token_ids == as_dict.prompt_token_ids
    assert rendered.prompt_token_ids[0] == bos and rendered.prompt_token_ids[1] != bos
    assert rendered.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert plain.prompt_token_ids == tok.encode("Hi")  # BOS still added to plain text
    assert ids.prompt_token_ids[:2] == [bos, bos]  # token ids are taken as given
    # Two BOS written in the text are the caller's: one added BOS is dropped, not theirs.
    twice = engine.core.inputs._prompt_token_ids(tok.bos_token * 2 + "Hi")
    assert twice == tok.encode(tok.bos_token * 2 + "Hi", add_special_tokens=False)


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_each_parameter_changes_the_output_as_documented(tiny_llama_dir, make_engine):
    prompts = _prompts()[:3]
    model = _hf(tiny_llama_dir)
    greedy = _reference(model, prompts, 6)
    repetition = _reference(model, prompts, 6, repetition_penalty=0.3)
    engine = make_engine(tiny_llama_dir, **F32)
    base = dict(max_tokens=6, ignore_eos=True)
    async with engine:

        async def run(**kw):
            outs = await gather(
                *(engine.generate(p, SamplingParams(**base, **kw)) for p in prompts)
            )
            return [o.token_ids for o in outs]

        assert await run(temperature=0.0) == greedy
        for seed in (1, 2, 12345):
            assert await run(temperature=0.0, seed=seed) == greedy
            assert await run(temperature=1.3, top_k=1, seed=seed) == greedy
        # repetition_penalty is transformers' (CTRL) over prompt + output tokens; below 1 it
        # favours them, which a random model shows best
        assert await run(temperature=0.0, repetition_penalty=0.3) == repetition
        assert repetition != greedy
        assert await run(temperature=1.0, logit_bias={4242: 100}) == [[4242] * 6] * 3
        banned = greedy[0][0]
        outs = await run(temperature=0.0, logit_bias={banned: -100})
        assert all(banned not in o for o in outs)
        # a sampled request differs from greedy, and its seed reproduces it
        sampled = await run(temperature=1.0, seed=3)
        assert sampled != greedy and sampled == await run(temperature=1.0, seed=3)
        # a strong frequency penalty never repeats a token within 6 greedy steps
        outs = await run(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
        assert all(len(set(o)) == len(o) for o in outs)


async def test_min_tokens_suppresses_an_early_eos(tiny_llama_dir, make_engine):
    prompt = _prompts()[0]
    ref = _reference(_hf(tiny_llama_dir), [prompt], 10)[0]
    eos = ref[2]
    engine = make_engine(tiny_llama_dir, **F32)
    engine.core.inputs.eos_token_ids = frozenset({eos})
    async with engine:
        early = await engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0))
        late = await engine.generate(
            prompt, SamplingParams(max_tokens=10, temperature=0, min_tokens=6)
        )
        ignored = await engine.generate(
            prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        )
    assert early.finish_reason == "stop" and early.token_ids == ref[: ref.index(eos) + 1]
    assert early.stop_reason is None  # EOS, not a caller's stop token
    assert eos not in late.token_ids[:6]
    assert late.token_ids[:2] == ref[:2] and late.token_ids[2] != eos
    assert len(late.token_ids) > 6
    assert late.finish_reason == ("stop" if late.token_ids[-1] == eos else "length")
    assert ignored.token_ids == ref


# --------------------------------------------------------------------------- stop strings

TEXT = "The quick brown fox jumps over the lazy dog, again and again."


@pytest.mark.parametrize(
    ("stop", "before"),
    [
        ("ick bro", "The qu"),  # " quick" + " brown": two tokens
        ("ck brown fo", "The qui"),  # " quick" + " brown" + " fox": three tokens
        ("The", ""),  # the very first token
    ],
)
@pytest.mark.parametrize("include", [False, True])
async def test_stop_strings_across_token_boundaries(
    stop, before, include, tiny_llama_dir, make_engine
):
    engine = make_engine(tiny_llama_dir, **SMALL)
    ids = _script(engine, TEXT)
    pieces = [engine.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    end = next(i for i, t in enumerate(pieces) if stop in t)  # the token completing it
    params = SamplingParams(
        max_tokens=len(ids), ignore_eos=True, stop=["zzz", stop], include_stop_str_in_output=include
    )
    async with engine:
        items = await _items(engine.stream(_prompts()[1], params))
        out = await engine.generate(_prompts()[1], params)
    expected = before + (stop if include else "")
    assert "".join(i.text for i in items) == out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ids[: end + 1]
    assert items[-1].num_generated_tokens == end + 1


async def test_text_that_may_start_a_stop_string_is_held_back(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    ids = _script(engine, TEXT)
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=["lazy cat", "dog!"])
    seen = ""
    async with engine:
        async for out in engine.stream(_prompts()[1], params):
            seen += out.text
            decoded = engine.tokenizer.decode(ids[: out.num_generated_tokens])
            if decoded.endswith(" lazy"):
                assert not seen.endswith("lazy")  # could become "lazy cat"
            if decoded.endswith(" dog"):
                assert not seen.endswith("dog")  # could become "dog!"
    assert seen == TEXT and out.finish_reason == "length" and out.stop_reason is None


async def test_stop_token_ids_and_min_tokens_with_stop_strings(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    ids = _script(engine, TEXT)
    brown = ids[2]  # " brown"
    async with engine:
        out = await engine.generate(
            _prompts()[1], SamplingParams(max_tokens=20, stop_token_ids=[brown])
        )
        assert (out.finish_reason, out.stop_reason, out.text) == ("stop", brown, "The quick")
        assert out.token_ids == ids[:3]
        out = await engine.generate(
            _prompts()[1],
            SamplingParams(max_tokens=20, stop_token_ids=[brown], include_stop_str_in_output=True),
        )
        assert out.text == "The quick brown"
        # Stop strings and stop tokens count only once min_tokens tokens are generated.
        out = await engine.generate(
            _prompts()[1], SamplingParams(max_tokens=20, stop=["quick"], min_tokens=4)
        )
        assert out.finish_reason == "length" and out.text.startswith("The quick brown fox")
        out = await engine.generate(
            _prompts()[1], SamplingParams(max_tokens=20, stop=["fox"], min_tokens=3)
        )
        assert out.text == "The quick brown " and out.stop_reason == "fox"


async def test_skip_special_tokens_and_unbounded_max_tokens(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_model_len=24, **SMALL)
    ids = _script(engine, "<|im_start|>assistant hello<|im_end|> bye")
    assert ids[0] == engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    prompt = _prompts()[2]  # 12 tokens: room for 12 more
    async with engine:
        skip = await engine.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True))
        keep = await engine.generate(
            prompt,
            SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=False),
        )
    assert skip.finish_reason == "length" and len(skip.token_ids) == 24 - 12
    assert skip.text.startswith("assistant hello bye")
    assert keep.text == "<|im_start|>assistant hello<|im_end|> bye"


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_emoji_and_cjk_streams_never_split_characters(tiny_llama_dir, make_engine):
    text = "你好，世界！🤖👍🏽 数据科学 🎉🇯🇵 漢字とかな ok 😀"
    engine = make_engine(tiny_llama_dir, max_num_seqs=16, **SMALL)
    ids = _script(engine, text)
    assert len(ids) > len(text)  # byte tokens: characters span several tokens
    rng = random.Random(7)

    async def reader(kind, stop):
        params = SamplingParams(max_tokens=len(ids), ignore_eos=True, output_kind=kind, stop=stop)
        deltas = []
        async for out in engine.stream(_prompts()[rng.randrange(6)], params):
            deltas.append(out.text)
            if rng.random() < 0.3:
                await anyio.sleep(rng.random() * 0.02)  # a slow reader: items merge
        return deltas, out

    async with engine:
        runs = await gather(
            *(reader("delta", None) for _ in range(8)),
            *(reader("cumulative", None) for _ in range(4)),
            reader("delta", ["世界！"]),
            reader("delta", ["🎉🇯🇵"]),
        )
    for deltas, _ in runs[:8]:
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == text
    for items, last in runs[8:12]:
        assert all("\ufffd" not in t for t in items)
        assert all(b.startswith(a) for a, b in itertools.pairwise(items))
        assert last.text == text
    assert "".join(runs[12][0]) == "你好，"
    assert "".join(runs[13][0]) == "你好，世界！🤖👍🏽 数据科学 "


# --------------------------------------------------------------------------- prompts and chat


async def test_output_kinds(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    prompt = _prompts()[2]
    async with engine:
        whole = await engine.generate(prompt, GREEDY)
        delta = await _items(engine.stream(prompt, GREEDY))
        cumul = await _items(
            engine.stream(
                prompt, SamplingParams(**{**_fields(GREEDY), "output_kind": "cumulative"})
            )
        )
        final = await _items(
            engine.stream(prompt, SamplingParams(**{**_fields(GREEDY), "output_kind": "final"}))
        )
    assert len(delta) == 6 and _concat(d.token_ids for d in delta) == whole.token_ids
    assert [len(c.token_ids) for c in cumul] == [1, 2, 3, 4, 5, 6]
    assert cumul[-1].token_ids == whole.token_ids and cumul[-1].text == whole.text
    assert len(final) == 1 and final[0].token_ids == whole.token_ids
    assert final[0].text == whole.text and final[0].finish_reason == "length"
    assert all(o.finish_reason is None for o in delta[:-1] + cumul[:-1])


def _concat(lists):
    return list(itertools.chain.from_iterable(lists))


def _fields(params):
    return {f: getattr(params, f) for f in params.__struct_fields__}


async def test_prompt_forms_and_bad_requests(tiny_llama_dir, make_engine):
    np = pytest.importorskip("numpy")
    engine = make_engine(tiny_llama_dir, **SMALL)
    ids = engine.tokenizer.encode("Hello there")
    async with engine:
        ref = await engine.generate("Hello there", GREEDY)
        for prompt in (
            ids,
            tuple(ids),
            np.array(ids),
            torch.tensor(ids),
            {"prompt": "Hello there"},
            {"prompt_token_ids": ids},
        ):
            assert (await engine.generate(prompt, GREEDY)).token_ids == ref.token_ids
        bad = [
            (None, GREEDY, {}),
            (42, GREEDY, {}),
            (b"bytes", GREEDY, {}),
            ([1.5, 2.0], GREEDY, {}),
            ([True, 5], GREEDY, {}),
            ({"prompt": "x", "prompt_token_ids": [1]}, GREEDY, {}),
            ({"text": "x"}, GREEDY, {}),
            ("x", SamplingParams(stop_token_ids=[10**6]), {}),
            ("x", SamplingParams(logit_bias={49152: 1}), {}),
            ("x", GREEDY, {"timeout": 0}),
            ("x", GREEDY, {"timeout": float("nan")}),
            ("x", GREEDY, {"timeout": "1"}),
            ("x", GREEDY, {"request_id": ""}),
            ("x", GREEDY, {"priority": 1.5}),
        ]
        for prompt, params, kw in bad:
            with pytest.raises(InvalidRequestError):
                await engine.generate(prompt, params, **kw)
        # A caller mutating its params after submission changes nothing (validated copy).
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        gen = engine.stream(ids, params)
        first = await gen.__anext__()
        params.max_tokens = 1000
        params.temperature = "hot"
        rest = await _items(gen)
        assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 4


async def test_chat_applies_the_models_template(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    ids = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    async with engine:
        chat_items = await _items(engine.chat(messages, GREEDY))
        chat = await collect(engine.chat(messages, GREEDY), "delta")
        plain = await engine.generate(ids, GREEDY)
        for bad in ([], "hi", [{"content": "x"}], [{"role": "user", "content": 5}], [3]):
            with pytest.raises(InvalidRequestError):
                await _items(engine.chat(bad, GREEDY))
        # breaking out of a chat stream aborts its request at once
        gen = engine.chat(messages, SamplingParams(max_tokens=100, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        await wait_until(lambda: not engine.core.has_unfinished())
    assert chat.token_ids == plain.token_ids == _concat(i.token_ids for i in chat_items)
    assert chat.prompt_token_ids == list(ids)


async def test_every_item_has_finish_reason_and_the_last_has_metrics(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    prompt = _prompts()[3]
    async with engine:
        items = await _items(engine.stream(prompt, GREEDY))
    assert [i.finish_reason for i in items] == [None] * 5 + ["length"]
    assert all(i.metrics is None for i in items[:-1])
    m = items[-1].metrics
    assert m is not None
    assert (m.num_prompt_tokens, m.num_generated_tokens, m.num_cached_tokens) == (20, 6, 0)
    assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency
    assert m.mean_tpot > 0
    assert m.ttft + 5 * m.mean_tpot == pytest.approx(m.e2e_latency, abs=0.05)
    assert items[-1].prompt_token_ids == prompt


# --------------------------------------------------------------------------- overload, timeout


def _slow_steps(engine, seconds):
    real = engine.core.step

    def slow():
        time.sleep(seconds)
        return real()

    engine.core.step = slow


async def test_queue_full_past_max_waiting(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_waiting=2, **SMALL)
    _slow_steps(engine, 0.005)
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    async with engine:
        running = engine.stream(_prompts()[0], long)
        await running.__anext__()
        async with anyio.create_task_group() as tg:
            waiting = [spawn(tg, engine.generate(p, long)) for p in _prompts()[1:3]]
            await wait_until(lambda: engine.stats()["num_waiting"] == 2)
            with pytest.raises(QueueFull) as info:
                await engine.generate("one more", GREEDY)
            assert isinstance(info.value, AsyncLLMError)
            await running.aclose()  # one waiting request starts: there is room again
            await wait_until(lambda: engine.stats()["num_waiting"] == 1)
            extra = spawn(tg, engine.generate("one more", GREEDY))
            for t in waiting:
                t.cancel()
            assert (await extra.result()).finish_reason == "length"


async def test_a_call_larger_than_max_waiting_is_invalid_not_queue_full(
    tiny_llama_dir, make_engine
):
    """n samples beyond max_waiting are never taken, even by an idle engine: an
    InvalidRequestError (400), not QueueFull ("try again later", which a retrying caller
    repeats forever), for text and token-id prompts; n within it is served."""
    engine = make_engine(tiny_llama_dir, max_num_seqs=4, max_waiting=2, **SMALL)
    async with engine:
        for prompt in ("hello there", _prompts()[0]):
            with pytest.raises(InvalidRequestError, match="max_waiting=2") as info:
                await engine.generate(prompt, SamplingParams(n=3, max_tokens=2))
            assert not isinstance(info.value, QueueFull)
        out = await engine.generate(_prompts()[0], SamplingParams(n=2, max_tokens=2))
        assert out.samples is not None and len(out.samples) == 2
        await wait_until(lambda: not engine.core.has_unfinished())
        check_pool_whole(engine)


async def test_timeout_ends_running_and_waiting_requests(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, **SMALL)
    _slow_steps(engine, 0.01)
    long = SamplingParams(max_tokens=1000, ignore_eos=True)
    async with engine, anyio.create_task_group() as tg:
        running = spawn(tg, engine.generate(_prompts()[0], long, timeout=0.3))
        await wait_until(lambda: engine.stats()["num_running"] == 1)
        waiting = await engine.generate(_prompts()[1], long, timeout=0.05)
        out = await running.result()
        await wait_until(lambda: not engine.core.has_unfinished())
    assert waiting.finish_reason == "timeout" and waiting.token_ids == []
    assert out.finish_reason == "timeout" and 0 < len(out.token_ids) < 1000
    assert out.metrics is not None and out.metrics.num_generated_tokens == len(out.token_ids)


# --------------------------------------------------------------------------- aborts


async def test_abort_by_id_from_another_task_and_thread(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    async with engine, anyio.create_task_group() as tg:
        a = spawn(tg, engine.generate(_prompts()[0], long, request_id="a"))
        b = spawn(tg, engine.generate(_prompts()[1], long, request_id="b"))
        await wait_until(lambda: engine.stats()["num_running"] == 2)
        with pytest.raises(InvalidRequestError, match="duplicate"):
            await engine.generate("x", GREEDY, request_id="a")
        engine.abort("a")
        threading.Thread(target=engine.abort, args=("b",)).start()
        engine.abort("no-such-request")
        out_a, out_b = await a.result(), await b.result()
        await wait_until(lambda: not engine.core.has_unfinished())
        again = await engine.generate(_prompts()[0], GREEDY, request_id="a")  # id is free again
    assert out_a.finish_reason == out_b.finish_reason == "abort"
    assert again.finish_reason == "length"


async def test_200_concurrent_streams_with_random_cancellation(tiny_llama_dir, make_engine):
    """Random streams leave at random points: break, aclose, cancelling the consuming task,
    or abort by id from another task (0 tokens in: while waiting or prefilling)."""
    prompts = _prompts()
    expected = _reference(_hf(tiny_llama_dir), prompts, GREEDY.max_tokens)
    engine = make_engine(
        tiny_llama_dir,
        block_size=4,
        kv_cache_bytes=2**21,
        max_num_batched_tokens=128,
        dtype="float32",
    )
    rng = random.Random(2024)
    modes = ["complete"] * 5 + ["break", "aclose", "cancel", "abort"]
    plan = [(i, rng.choice(modes), rng.randrange(0, GREEDY.max_tokens)) for i in range(200)]
    results: dict[int, tuple[list[int], str | None]] = {}
    reached = {i: anyio.Event() for i, _, _ in plan}

    async def consume(i, mode, k):
        gen = engine.stream(prompts[i % 6], GREEDY, request_id=f"s{i}")
        ids: list[int] = []
        out = None
        if k == 0:
            reached[i].set()
        async for out in gen:
            ids.extend(out.token_ids)
            if len(ids) >= k:
                reached[i].set()
            if mode in ("break", "aclose") and len(ids) >= max(k, 1):
                break
        if mode == "aclose":
            await gen.aclose()
        results[i] = (ids, out.finish_reason if out else None)

    async def interrupt(i, mode, task):
        await reached[i].wait()
        await anyio.sleep(rng.random() * 0.005)
        if mode == "cancel":
            task.cancel()
        else:
            engine.abort(f"s{i}")

    async with engine:
        tasks = {}
        async with anyio.create_task_group() as tg:
            for i, mode, k in plan:
                tasks[i] = spawn(tg, consume(i, mode, k))
                if mode in ("cancel", "abort"):
                    spawn(tg, interrupt(i, mode, tasks[i]))
                if rng.random() < 0.2:
                    await anyio.sleep(0)
        assert not [t.exception() for t in tasks.values() if t.exception()]
        await wait_until(lambda: not engine.core.has_unfinished())
        check_pool_whole(engine)
    outcomes = collections.Counter()
    for i, mode, _k in plan:
        if tasks[i].cancelled():
            assert mode == "cancel"
            outcomes[mode, "cancelled"] += 1
            continue
        ids, reason = results[i]
        outcomes[mode, reason] += 1
        want = expected[i % 6]
        if reason == "length":
            assert ids == want, (i, mode)
        else:
            assert (mode, reason) in (("break", None), ("aclose", None), ("abort", "abort"))
            assert ids == want[: len(ids)]
    assert outcomes["complete", "length"] > 100
    # Every way out happened, most of them before the end.
    assert outcomes["cancel", "cancelled"] >= 10 and outcomes["abort", "abort"] >= 10
    assert outcomes["break", None] >= 10 and outcomes["aclose", None] >= 10


# --------------------------------------------------------------------------- failure, shutdown


def _engine_threads():
    return [t for t in threading.enumerate() if t.name.startswith("asyncllm")]


async def test_fault_in_forward_ends_every_stream_with_engine_dead_error(
    tiny_llama_dir, make_engine
):
    engine = make_engine(tiny_llama_dir, **SMALL)
    runner = engine.core.runner
    real_forward = runner._forward
    fault = threading.Event()

    def faulty(*args, **kwargs):
        if fault.is_set():
            raise RuntimeError("injected fault")
        return real_forward(*args, **kwargs)

    runner._forward = faulty
    long = SamplingParams(max_tokens=10_000, ignore_eos=True)
    got: list[int] = [0] * 8

    async def consume(i):
        async for out in engine.stream(_prompts()[i % 6], long):
            got[i] += len(out.token_ids)

    async with engine, anyio.create_task_group() as tg:
        assert engine.health() == "running"
        tasks = [spawn(tg, consume(i)) for i in range(8)]
        await wait_until(lambda: all(got))
        fault.set()
        with anyio.move_on_after(1.0):  # every stream ends at once: within a second
            for t in tasks:
                await t.done.wait()
        assert all(t.done.is_set() for t in tasks)
        for t in tasks:
            err = t.exception()
            assert isinstance(err, EngineDeadError)
            assert isinstance(err.__cause__, RuntimeError) and "injected" in str(err.__cause__)
        with pytest.raises(EngineDeadError) as info:
            await engine.generate("hello", GREEDY)
        assert "injected" in str(info.value.__cause__)
        with pytest.raises(EngineDeadError):
            engine.health()
    assert not _engine_threads()
    with pytest.raises(EngineDeadError):
        engine.health()


@pytest.mark.parametrize("mode", ["abort", "drain"])
async def test_leaving_the_context_aborts_or_drains_and_joins(mode, tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, shutdown_mode=mode, **SMALL)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    assert engine.health() == "stopped"
    async with anyio.create_task_group() as tg:
        async with engine:
            tasks = [spawn(tg, engine.generate(p, params)) for p in _prompts()]
            # The tasks submit their requests in their first run, before any suspension.
            await wait_until(lambda: all(t.started for t in tasks))
            assert engine.health() == "running"
        assert engine.health() == "stopped"
        assert not _engine_threads()
        outs = [await t.result() for t in tasks]
    if mode == "drain":
        assert all(o.finish_reason == "length" and len(o.token_ids) == 20 for o in outs)
    else:
        assert all(o.finish_reason == "abort" for o in outs)
    with pytest.raises(EngineNotRunningError):
        await engine.generate("hi", GREEDY)


async def test_cancelling_a_drain_aborts_the_rest_and_still_joins(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, shutdown_mode="drain", **SMALL)
    _slow_steps(engine, 0.01)  # ~250 tokens (max_model_len) outlast the deadline by far
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    async with anyio.create_task_group() as tg:
        with anyio.move_on_after(0.3) as scope:
            async with engine:
                task = spawn(tg, engine.generate(_prompts()[0], params))
                await wait_until(lambda: engine.stats()["num_running"] == 1)
            # the block ended: the exit drains until the deadline cancels it
        assert scope.cancelled_caught
        assert engine.health() == "stopped" and not _engine_threads()
        out = await task.result()
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 250


async def test_an_exception_in_the_block_aborts_even_in_drain_mode(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, shutdown_mode="drain", **SMALL)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    async with anyio.create_task_group() as tg:
        with pytest.raises(KeyError):
            async with engine:
                task = spawn(tg, engine.generate(_prompts()[0], params))
                await wait_until(lambda: engine.stats()["num_running"] == 1)
                raise KeyError("boom")
        assert (await task.result()).finish_reason == "abort"


# --------------------------------------------------------------------------- the sync facade


def test_llm_facade_generates_in_scripts_and_inside_a_running_loop(tiny_llama_dir):
    prompts = _prompts()
    expected = _reference(_hf(tiny_llama_dir), prompts, GREEDY.max_tokens)
    with LLM(str(tiny_llama_dir), **F32) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected
        assert all(o.finish_reason == "length" and o.metrics is not None for o in outs)
        per = [GREEDY, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)]
        two = llm.generate(prompts[:2], per, use_tqdm=False)
        assert [len(o.token_ids) for o in two] == [6, 2]
        assert llm.generate(prompts[0], GREEDY)[0].token_ids == expected[0]  # flat token ids
        assert len(llm.generate("Hello", GREEDY, use_tqdm=False)) == 1
        with pytest.raises(InvalidRequestError):
            llm.generate(prompts[:2], [GREEDY])

        async def notebook_cell():  # Jupyter runs cells inside a running loop
            return llm.generate(prompts[:1], GREEDY, use_tqdm=False)

        assert asyncio.run(notebook_cell())[0].token_ids == expected[0]
        msgs = [{"role": "user", "content": "hi"}]
        chats = llm.chat([msgs, msgs], SamplingParams(max_tokens=3, temperature=0))
        assert len(chats) == 2 and chats[0].token_ids == chats[1].token_ids
        cum = SamplingParams(max_tokens=4, temperature=0, output_kind="cumulative")
        assert len(llm.chat(msgs, cum)[0].token_ids) == 4
        check_pool_whole(llm.engine)
    assert not _engine_threads()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x")


def test_llm_facade_retries_past_a_bounded_queue(tiny_llama_dir):
    prompts = _prompts()
    with LLM(str(tiny_llama_dir), max_num_seqs=1, max_waiting=1, **SMALL) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
        check_pool_whole(llm.engine)


def test_llm_facade_refuses_a_call_larger_than_max_waiting(tiny_llama_dir):
    """The facade retries on QueueFull; a call that can never be taken must raise instead
    of retrying forever."""
    errors: list[BaseException] = []
    with LLM(str(tiny_llama_dir), max_num_seqs=4, max_waiting=2, **SMALL) as llm:

        def call() -> None:
            try:
                llm.generate(["hi"], SamplingParams(n=3, max_tokens=2), use_tqdm=False)
            except BaseException as e:
                errors.append(e)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "LLM.generate kept retrying a call it can never make"
        assert len(errors) == 1 and isinstance(errors[0], InvalidRequestError)
        (out,) = llm.generate(["hi"], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
        assert out.samples is not None and len(out.samples) == 2
        check_pool_whole(llm.engine)


@pytest.mark.parametrize(
    ("params", "message"),
    [("notparams", "got str"), (b"x", "got bytes"), ([SamplingParams()] * 2, "a list of 2")],
)
def test_llm_params_of_the_wrong_kind_are_named(params, message):
    """A string is a Sequence: it was reported by its length ("got 9")."""
    from asyncllm.errors import InvalidRequestError
    from asyncllm.llm import LLM

    with pytest.raises(InvalidRequestError, match=message):
        LLM._params_list(params, 1)
