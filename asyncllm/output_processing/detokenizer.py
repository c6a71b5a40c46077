"""Incremental (streaming) detokenization.

Generated tokens arrive one or a few at a time; :class:`IncrementalDetokenizer` turns each batch
into the *text delta* it adds, without ever decoding the whole sequence again.

Algorithm (the "prefix offset / read offset" technique of vLLM's ``detokenize_incrementally`` /
``SlowIncrementalDetokenizer`` and text-generation-inference's ``Model.decode_token``; tokenizers'
Rust ``DecodeStream`` does the same thing):

* Keep a short list of token ids and two offsets into it. ``ids[prefix_offset:read_offset]`` is
  the *context* window: tokens whose text has already been emitted, kept only so that decoding is
  done in context. ``ids[read_offset:]`` are tokens whose text has not been emitted yet.
* On each step decode ``prefix_text = decode(ids[prefix_offset:read_offset])`` and
  ``new_text = decode(ids[prefix_offset:])`` and emit ``new_text[len(prefix_text):]``; then slide
  the window: ``prefix_offset = read_offset; read_offset = len(ids)``.
* Decoding the context along with the new tokens is what gets spaces right: a sentencepiece
  (Metaspace ``"▁"``) decoder strips the leading space of the *first* token it decodes, so decoding
  ``"▁world"`` alone gives ``"world"``, while ``decode(["▁Hello", "▁world"])`` minus
  ``decode(["▁Hello"])`` gives ``" world"``. Byte-level BPE (GPT-2 / Llama-3 / SmolLM2, ``"Ġ"``)
  has no such stripping and works the same way.
* The window is seeded with the last :data:`PROMPT_CONTEXT_TOKENS` (5) prompt tokens (special
  tokens left out when they are skipped), so the first generated token is decoded in context too:
  after a prompt, a generated ``"▁Hello"`` yields ``" Hello"``.
* Hold-back: while ``new_text`` ends with U+FFFD (the decoder's rendering of an incomplete UTF-8
  sequence, e.g. the first of the byte tokens ``<0xF0><0x9F><0xA4><0x96>`` of "🤖", or a byte-level
  ``"ðŁ"``), nothing is emitted and the offsets stay put; the text comes out once the character is
  complete. Likewise nothing is emitted (and the window is not slid) while the new tokens add no
  text. The hold-back is bounded: at most :data:`MAX_HELD_TOKENS` (3) tokens are held. An
  incomplete character has at most 3 bytes and every token of a byte-level or byte-fallback
  vocabulary at least one, so a U+FFFD before the last 3 tokens is permanent (invalid bytes) and
  is emitted, as ``decode()`` renders it. So a model that generates invalid UTF-8 (a run of
  ``0x80`` bytes) streams one U+FFFD per token, 3 tokens late, at a constant cost per step.
  A U+FFFD followed by other text is emitted at once with it. :meth:`IncrementalDetokenizer.flush`
  emits whatever is still held, as ``decode()`` renders it, but for a truncated character at the
  very end (``max_tokens`` reached inside it): its bytes are left out, not rendered as U+FFFD, so
  the final text ends on its last complete character. (Invalid bytes before it stay U+FFFD.)
* When several tokens arrive at once and their text ends with an incomplete character, the text
  of the longest complete prefix of the batch is still emitted, so the deltas do not depend on how
  the tokens are batched.
* A prompt that ends inside a UTF-8 character (a truncated prompt, or one given as token ids):
  **the character the output completes belongs to the output text.** Prompt "Hello world " +
  ``<0xF0><0x9F>``, output ``<0xA4><0x96>`` "a" "b" "c": the text is "🤖abc". The prompt's
  trailing bytes of that character (found with :func:`token_bytes`, the tokenizer's own
  token-to-bytes mapping) are treated as not yet emitted: tokens that hold only such bytes are
  held back as if generated, and the U+FFFD that renders the incomplete character is left out of
  the context text (byte-level BPE, where the character may start inside a token like ``"Ġð"``).
  The user sees ``dec(P)`` with its trailing U+FFFD, then the output completing it, as the
  concatenation ``dec(P + G)`` shows. (vLLM's and TGI's ``prefix_offset`` / ``read_offset``
  slicing by length instead drops the completed character, and then as many characters of the
  output as ``dec(P)`` had U+FFFD too many: the "bc" of the example.) Tokenizers whose tokens
  :func:`token_bytes` cannot map (none of the above decoders) keep that slicing.
* With ``skip_special_tokens=True`` special tokens are dropped on arrival (they decode to nothing,
  and ``decode`` drops them before running the decoder anyway), so they never enter the window.

Invariant (the one vLLM and TGI provide). Let ``P`` be the prompt ids and ``G`` all ids passed to
:meth:`~IncrementalDetokenizer.add_tokens`, and ``dec(x) = tokenizer.decode(x,
skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)``. Then the
concatenation of all deltas and the final :meth:`~IncrementalDetokenizer.flush` is::

    dec(P + G)[len(prompt_text):]

less the U+FFFD that renders a trailing incomplete character of ``P + G`` (one for byte-level
BPE; one per byte token for ByteFallback), where ``prompt_text`` is the prompt's text up to its
last complete character: ``dec(P)``, or for a prompt ending inside a character ``dec`` of ``P``
without the trailing tokens that hold only bytes of that character (less the one U+FFFD that
renders it when it starts inside a token). That is, the text the generated tokens add to the
prompt's text, up to its last complete character. This is **not**
``dec(G)``: for a sentencepiece tokenizer ``dec(G)`` drops the leading space of the first
generated word, which the stream keeps. (With an empty prompt the two coincide.) The same holds
for each prefix of ``G`` that ends on a complete character: the concatenated deltas so far equal
``dec(P + G[:k])[len(prompt_text):]``. No delta contains U+FFFD unless that U+FFFD is in the final
text too. For byte-level BPE all this holds for *any* id sequence, even invalid UTF-8.
``clean_up_tokenization_spaces`` is always off: that clean-up ("a ." -> "a.") is not
local, so it cannot be applied to a stream (transformers 5 ignores it for BPE tokenizers anyway).

The invariant relies on the decoder being local (the text of a token depends only on a few
neighbours), which holds for byte-level BPE, Metaspace/sentencepiece and WordPiece decoders.
Known exception, shared with vLLM/TGI: a byte-fallback tokenizer (``<0xNN>`` tokens) with
*invalid* UTF-8:
the ``ByteFallback`` decoder renders a whole run of consecutive byte tokens as U+FFFD (one per
token) as soon as any byte in the run is invalid, so ``dec`` also turns the run's earlier, valid,
already emitted characters into U+FFFD, while the stream keeps them (and the U+FFFD it emits for
the run may then differ in number from ``dec``'s, as the delta is cut from the window's text by
length). Matching that would mean holding every byte-token run until a non-byte token ends it
(unbounded latency for text in scripts the vocabulary lacks) for output that is garbage anyway;
vLLM and TGI do not either. Valid UTF-8 output is unaffected.

Cost per call: one ``decode`` of the window (plus one for the context text when the window
slid), where the window is the tokens of the previous emission plus the tokens not yet emitted
(at most :data:`MAX_HELD_TOKENS` once a call returns) -- usually 2-8 tokens -- so O(window),
independent of the prompt and output lengths. Memory is O(window) too: ids before
``prefix_offset`` are dropped. When the text ends with an incomplete character, up to
:data:`MAX_HELD_TOKENS` more window decodes find its longest complete prefix.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["MAX_HELD_TOKENS", "PROMPT_CONTEXT_TOKENS", "IncrementalDetokenizer", "token_bytes"]

#: How many trailing prompt tokens seed the decoding window (vLLM's
#: ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``).
PROMPT_CONTEXT_TOKENS = 5

#: The most tokens whose text may be held back: an incomplete UTF-8 character has at most 3
#: bytes, and every token of a byte-level or byte-fallback vocabulary holds at least one.
MAX_HELD_TOKENS = 3

_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


#: Per tokenizer (a weak reference): its special ids.
_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids ``tokenizer.decode(..., skip_special_tokens=True)`` drops. Memoised per
    tokenizer, as :func:`token_bytes`' map (the engine's tokenizer does not change after
    load): listing a large set of added tokens (Gemma 3's) is slow, and it ran on the event
    loop for every request (docs/tuning.md, "Gemma 3's prefill")."""
    known = _SPECIAL_IDS.get(tokenizer)
    if known is not None:
        return known
    if hasattr(tokenizer, "backend_tokenizer"):
        # Fast (Rust) tokenizers skip the added tokens flagged special, which can be more than
        # ``all_special_ids`` (e.g. SmolLM2's ``<repo_name>``, ``<file_sep>``...).
        ids = {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
        found = frozenset(ids.union(tokenizer.all_special_ids))
    else:
        found = frozenset(tokenizer.all_special_ids)
    _SPECIAL_IDS[tokenizer] = found
    return found


# ---------------------------------------------------------------------------- token bytes


def _decoder_steps(spec: Any) -> list[dict[str, Any]]:
    """A tokenizers decoder spec (JSON) as a flat list of its steps (``Sequence`` unrolled)."""
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [step for sub in spec.get("decoders", ()) for step in _decoder_steps(sub)]
    return [spec]


class _TokenBytesMap:
    """One tokenizer's id -> raw bytes mapping, memoised (see :func:`token_bytes`)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self._added = {
            int(i): str(getattr(t, "content", t))
            for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        self._byte_decoder: dict[str, int] | None = None
        self._byte_fallback = False
        self._replacements: list[tuple[str, str]] = []
        self._known = True  # False: fall back to decode([id])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            decoder = backend.decoder
            steps = _decoder_steps(json.loads(decoder.__getstate__())) if decoder else []
            kinds = {step.get("type") for step in steps}
            if "ByteLevel" in kinds:
                self._byte_decoder = _gpt2_byte_decoder()
            self._byte_fallback = "ByteFallback" in kinds
            for step in steps:
                if step.get("type") == "Metaspace":
                    self._replacements.append((step.get("replacement", "\u2581"), " "))
                elif step.get("type") == "Replace" and "String" in step.get("pattern", {}):
                    self._replacements.append((step["pattern"]["String"], step["content"]))
            self._known = bool(kinds) and kinds <= {
                "ByteLevel", "ByteFallback", "Metaspace", "Replace", "Fuse", "Strip",
            }  # fmt: skip
        elif hasattr(tokenizer, "byte_decoder"):  # slow GPT-2 style tokenizer
            self._byte_decoder = dict(tokenizer.byte_decoder)
        elif hasattr(tokenizer, "sp_model"):  # slow sentencepiece tokenizer
            self._byte_fallback = True
            self._replacements.append(("\u2581", " "))
        else:
            self._known = False

    def __call__(self, token_id: int) -> bytes:
        data = self._cache.get(token_id)
        if data is None:
            data = self._bytes(token_id)
            self._cache[token_id] = data
        return data

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        if not self._known:
            return self._decode(token_id)
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            return self._decode(token_id)
        if self._byte_decoder is not None:
            try:
                return bytes(self._byte_decoder[c] for c in token)
            except KeyError:  # not a byte-level token after all
                return token.encode("utf-8")
        if self._byte_fallback:
            m = _BYTE_FALLBACK_TOKEN.fullmatch(token)
            if m is not None:
                return bytes([int(m.group(1), 16)])
        for pattern, content in self._replacements:
            token = token.replace(pattern, content)
        return token.encode("utf-8")

    def _decode(self, token_id: int) -> bytes:
        text = self._tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return str(text).encode("utf-8")


def _gpt2_byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]


_TOKEN_BYTES_MAPS: weakref.WeakKeyDictionary[Any, _TokenBytesMap] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The raw bytes token ``token_id`` stands for, from the tokenizer's own token-to-bytes
    mapping (not ``decode([id])``, which renders a piece of a UTF-8 character as U+FFFD).

    * Added and special tokens: their content as UTF-8 (``"<|im_end|>"``).
    * Byte-level BPE (GPT-2, Llama-3, Qwen, SmolLM2; a ``ByteLevel`` decoder): the inverse of
      GPT-2's ``bytes_to_unicode`` table (transformers' ``convert_slow_tokenizer``) applied to
      the token string, so ``"æ"`` is ``b"\\xe6"`` and ``"Ġworld"`` is ``b" world"``.
    * Byte fallback (sentencepiece / Llama-2 style, a ``ByteFallback`` decoder): a
      ``<0xNN>`` token is the byte 0xNN.
    * Sentencepiece pieces: the decoder's ``Metaspace`` / ``Replace`` steps applied, so
      ``"▁Hello"`` is ``b" Hello"`` (the leading space a whole-sequence decode would strip at
      the very start is kept: it is the token's, as tiktoken's ``" Hello"``).
    * Any other decoder (WordPiece...): ``decode([id])`` as UTF-8.

    Memoised per tokenizer (a weak reference; thread-safe enough for the GIL: a race at
    worst computes an entry twice). An id outside the vocabulary gives ``b""``.
    """
    mapping = _TOKEN_BYTES_MAPS.get(tokenizer)
    if mapping is None:
        mapping = _TokenBytesMap(tokenizer)
        _TOKEN_BYTES_MAPS[tokenizer] = mapping
    return mapping(int(token_id))


def _incomplete_utf8_tail(data: bytes) -> int:
    """How many trailing bytes of ``data`` are the start of a UTF-8 character that more bytes
    could still complete (0-3); invalid bytes are not counted."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-MAX_HELD_TOKENS:])
    return len(decoder.getstate()[0])


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas (see the module docstring).

    Args:
        tokenizer: the request's tokenizer (fast or slow).
        prompt_token_ids: the prompt's ids; only the last few are kept, as decoding context.
        skip_special_tokens: drop special tokens from the text, as ``decode`` does.

    ``"".join(deltas) + flush() == dec(prompt + generated)[len(dec(prompt)):]`` where
    ``dec = tokenizer.decode(..., skip_special_tokens=..., clean_up_tokenization_spaces=False)``.
    Not thread-safe; one instance per request (and per sequence, for n > 1).
    """

    __slots__ = (
        "_ids",
        "_pieces",
        "_prefix_offset",
        "_prefix_text",
        "_read_offset",
        "_skip_ids",
        "_skip_special_tokens",
        "_text",
        "_tokenizer",
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skip_ids: frozenset[int] = (
            _special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        )
        # Seed: the last PROMPT_CONTEXT_TOKENS prompt ids that decode to something (special
        # tokens are skipped, so a prompt ending in them still gives the first token context).
        seed: list[int] = []
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            if len(seed) == PROMPT_CONTEXT_TOKENS:
                break
            tid = int(prompt_token_ids[i])
            if tid not in self._skip_ids:
                seed.append(tid)
        seed.reverse()
        self._ids: list[int] = seed
        self._prefix_offset = 0
        self._read_offset = len(seed)
        # decode(ids[prefix_offset:read_offset]), computed lazily (None: not computed yet).
        self._prefix_text: str | None = None
        self._hold_prompt_tail()
        self._pieces: list[str] = []
        self._text = ""

    # ------------------------------------------------------------------ public API

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if self._pieces:
            self._pieces.insert(0, self._text)
            self._text = "".join(self._pieces)
            self._pieces.clear()
        return self._text

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append newly generated ids; return the text they complete ("" while held back)."""
        if self._skip_ids:
            new = [int(t) for t in token_ids if int(t) not in self._skip_ids]
        else:
            new = [int(t) for t in token_ids]
        if not new:
            return ""
        self._ids.extend(new)
        end = len(self._ids)
        delta = self._advance_to(end, force=False)
        if delta is None:
            # The text ends with U+FFFD: an incomplete character, whose bytes lie in the last
            # MAX_HELD_TOKENS tokens, or invalid bytes. Emit the longest prefix that ends on a
            # complete character; scanning from the back, the first such cut is the longest.
            # Cuts before this batch were tried (and held) by earlier calls.
            stop = max(end - len(new), end - MAX_HELD_TOKENS - 1, self._read_offset)
            for cut in range(end - 1, stop, -1):
                delta = self._advance_to(cut, force=False)
                if delta is not None:
                    break
        end = len(self._ids)  # the window may have slid
        if end - self._read_offset > MAX_HELD_TOKENS:
            # Held back too long: what lies before the last MAX_HELD_TOKENS tokens cannot be
            # part of the trailing incomplete character, so its U+FFFD are final. Emitting it
            # bounds the hold-back, and with it the window every call decodes.
            delta = (delta or "") + (self._advance_to(end - MAX_HELD_TOKENS, force=True) or "")
        return delta or ""

    def flush(self) -> str:
        """Emit everything still held back, as ``decode`` renders it (call at end of request),
        but without a trailing incomplete UTF-8 character: the bytes of a character that the
        output was cut inside (``max_tokens``) are dropped, never rendered as U+FFFD. Invalid
        bytes (that no further byte could complete) still come out as U+FFFD.

        Further tokens may still be added afterwards, but then the invariant is only kept if
        nothing was pending here.
        """
        end = len(self._ids)
        held = self._ids[self._read_offset :]
        tail = b"".join(token_bytes(self._tokenizer, t) for t in held[-MAX_HELD_TOKENS:])
        missing = _incomplete_utf8_tail(tail)
        if not missing:
            return self._advance_to(end, force=True) or ""
        # The trailing tokens that hold only bytes of the incomplete character are dropped;
        # one that also holds text before it (byte-level ``"Ġð"``) is decoded, and the one
        # U+FFFD of its partial character cut off.
        cut, dropped = end, 0
        while cut > self._read_offset:
            n = len(token_bytes(self._tokenizer, self._ids[cut - 1]))
            if dropped + n > missing:
                break
            dropped += n
            cut -= 1
        delta = self._advance_to(cut, force=True) or ""
        if dropped < missing and delta.endswith(_REPLACEMENT_CHAR):
            delta = delta[:-1]
            self._pieces[-1] = delta
        if cut < end:  # the dropped tokens are consumed, their text left out
            self._advance_to(len(self._ids), force=True)
            self._pieces.pop()
        return delta

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        # transformers types decode() as str | list[str]; a flat id list gives a str.
        return self._tokenizer.decode(  # type: ignore[return-value]
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _hold_prompt_tail(self) -> None:
        """A prompt that ends inside a UTF-8 character: its last bytes are not emitted text
        yet. Move the tokens that hold only such bytes behind ``read_offset`` (as if
        generated), and leave the U+FFFD that renders the incomplete character out of the
        context text, so the output's first character is the completed one."""
        seed = self._ids
        if not seed:
            return
        tail = b"".join(token_bytes(self._tokenizer, t) for t in seed[-MAX_HELD_TOKENS:])
        missing = _incomplete_utf8_tail(tail)
        if not missing:
            return
        held = 0  # bytes of the incomplete character in whole trailing tokens
        read = len(seed)
        while read > 0:
            n = len(token_bytes(self._tokenizer, seed[read - 1]))
            if held + n > missing:
                break
            held += n
            read -= 1
        prefix_text = self._decode(seed[:read])
        if held < missing and prefix_text.endswith(_REPLACEMENT_CHAR):
            # The character starts inside token ``read - 1`` (byte-level BPE: ``"Ġð"``), which
            # a lossy UTF-8 decode renders with one U+FFFD for the incomplete sequence.
            prefix_text = prefix_text[:-1]
        self._read_offset = read
        self._prefix_text = prefix_text

    def _advance_to(self, end: int, *, force: bool) -> str | None:
        """Try to emit the text of ``ids[read_offset:end]``.

        Returns the delta and slides the window, "" when those tokens add no text yet, or None
        when their text ends with an incomplete character (unless ``force``). With ``force``
        the window slides even when the tokens add no text.
        """
        if end <= self._read_offset:
            return ""
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            self._prefix_text = prefix_text
        new_text = self._decode(self._ids[self._prefix_offset : end])
        if not force and new_text.endswith(_REPLACEMENT_CHAR):
            return None
        if len(new_text) <= len(prefix_text) and not force:
            # Nothing new yet (e.g. a token that only opens a word); keep the context as is.
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide: the just-emitted tokens become the context. Drop ids before it (O(window)).
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = end - self._read_offset
        self._prefix_text = None
        self._pieces.append(delta)
        return delta
