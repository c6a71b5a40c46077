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
  text. A U+FFFD that is permanent (an invalid byte followed by more text) is emitted as soon as
  something follows it; :meth:`IncrementalDetokenizer.flush` emits whatever is still held, as
  ``decode()`` renders it (so a truncated character at the very end comes out as U+FFFD).
* When several tokens arrive at once and their text ends with an incomplete character, the text
  of the longest complete prefix of the batch is still emitted, so the deltas do not depend on how
  the tokens are batched.
* With ``skip_special_tokens=True`` special tokens are dropped on arrival (they decode to nothing,
  and ``decode`` drops them before running the decoder anyway), so they never enter the window.

Invariant (the one vLLM and TGI provide). Let ``P`` be the prompt ids and ``G`` all ids passed to
:meth:`~IncrementalDetokenizer.add_tokens`, and ``dec(x) = tokenizer.decode(x,
skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)``. Then the
concatenation of all deltas and the final :meth:`~IncrementalDetokenizer.flush` is::

    dec(P + G)[len(dec(P)):]

i.e. the text the generated tokens add to the prompt's text. This is **not** ``dec(G)``: for a
sentencepiece tokenizer ``dec(G)`` drops the leading space of the first generated word, which
the stream keeps. (With an empty prompt the two coincide.) The same holds for each prefix of
``G`` that ends on a complete character: the concatenated deltas so far equal
``dec(P + G[:k])[len(dec(P)):]``. No delta contains U+FFFD unless that U+FFFD is in the final
text too. For byte-level BPE all this holds for *any* id sequence, even invalid UTF-8.
``clean_up_tokenization_spaces`` is always off: that clean-up ("a ." -> "a.") is not
local, so it cannot be applied to a stream (transformers 5 ignores it for BPE tokenizers anyway).

The invariant relies on the decoder being local (the text of a token depends only on a few
neighbours), which holds for byte-level BPE, Metaspace/sentencepiece and WordPiece decoders.
Known exceptions, shared with vLLM/TGI: (a) a prompt whose last tokens end in the middle of a
UTF-8 character (a truncated prompt): ``dec(P)`` then ends with U+FFFD and the slicing above
loses the completed character -- the stream matches that slicing; (b) a byte-fallback tokenizer
(``<0xNN>`` tokens) whose model generates *invalid* UTF-8: the ``ByteFallback`` decoder renders
a whole run of consecutive byte tokens as U+FFFD (one per token) as soon as any byte in the run
is invalid, so ``dec`` also turns the run's earlier, valid, already emitted characters into
U+FFFD, while the stream keeps them (and the U+FFFD it emits for the run may then differ in
number from ``dec``'s, as the delta is cut from the window's text by length). Matching that
would mean holding every byte-token run until a non-byte token ends it (unbounded latency for
text in scripts the vocabulary lacks) for output that is garbage anyway; vLLM and TGI do not
either. Valid UTF-8 output is unaffected.

Cost per call: one ``decode`` of the window (plus one for the context text when the window
slid), where the window is the tokens of the previous emission plus the tokens not yet emitted --
usually 2-8 tokens -- so O(window), independent of the prompt and output lengths. Memory is
O(window) too: ids before ``prefix_offset`` are dropped. When a batch of ``k`` tokens ends with an
incomplete character, up to ``k`` more window decodes find its longest complete prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PROMPT_CONTEXT_TOKENS", "IncrementalDetokenizer"]

#: How many trailing prompt tokens seed the decoding window (vLLM's
#: ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids ``tokenizer.decode(..., skip_special_tokens=True)`` drops."""
    if hasattr(tokenizer, "backend_tokenizer"):
        # Fast (Rust) tokenizers skip the added tokens flagged special, which can be more than
        # ``all_special_ids`` (e.g. SmolLM2's ``<repo_name>``, ``<file_sep>``...).
        ids = {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
        return frozenset(ids.union(tokenizer.all_special_ids))
    return frozenset(tokenizer.all_special_ids)


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
            # The batch ends with an incomplete character: emit what its complete prefix adds.
            # Scanning from the back, the first cut that decodes to a complete text is the longest.
            for cut in range(end - 1, end - len(new), -1):
                delta = self._advance_to(cut, force=False)
                if delta is not None:
                    break
        return delta or ""

    def flush(self) -> str:
        """Emit everything still held back, as ``decode`` renders it (call at end of request).

        A trailing incomplete UTF-8 sequence comes out as U+FFFD. Further tokens may still be
        added afterwards, but then the invariant is only kept if nothing was pending here.
        """
        return self._advance_to(len(self._ids), force=True) or ""

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _advance_to(self, end: int, *, force: bool) -> str | None:
        """Try to emit the text of ``ids[read_offset:end]``.

        Returns the delta and slides the window, "" when those tokens add no text yet, or None
        when their text ends with an incomplete character (unless ``force``).
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
        if len(new_text) <= len(prefix_text):
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
