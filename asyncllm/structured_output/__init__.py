"""Grammar-constrained decoding (``SamplingParams.structured_outputs``) on xgrammar.

xgrammar (https://github.com/mlc-ai/xgrammar, the default backend of vLLM and SGLang)
compiles a JSON schema, regex or EBNF grammar against the model's vocabulary into a
``CompiledGrammar``; a ``GrammarMatcher`` per request then tracks the output so far and fills,
each step, a bitmask of the tokens that may come next (one bit per token, int32 words).

Who does what, and on which thread:

* :class:`GrammarCompiler` compiles, with an LRU cache keyed by the grammar's text
  (:meth:`StructuredOutputsParams.cache_key`), so agents that send one schema again and again
  compile it once. The async front end calls it on a grammar thread of its own (never the
  event loop, never the engine's compute thread): a slow compile delays only its request.
* :class:`GrammarMatchers` holds one matcher per constrained core request, keyed by the
  internal request id (a parallel sample has its own). The engine's compute thread fills the
  step's bitmask from them before sampling (cheap) and advances them with the sampled
  tokens; a matcher is freed when its request finishes, is aborted, or stops on a stop string.
  Preemption leaves a matcher alone: it has accepted exactly the request's output tokens,
  and a recomputed request re-prefills those tokens without sampling them again.

The sampler applies the bitmask with xgrammar's kernel for the logits' device
(:func:`apply_token_bitmask`). xgrammar is imported on first use (it takes seconds).
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from asyncllm.core.request import RequestStatus
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling_params import StructuredOutputsParams

#: Compiled grammars a :class:`GrammarCompiler` keeps (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; callers need the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _xgr() -> Any:
    import xgrammar

    return xgrammar


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer, thread-safe, with an LRU
    cache of :data:`GRAMMAR_CACHE_SIZE` grammars keyed by their text.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: rows of the model's output layer (>= the tokenizer's vocabulary: ids
            past it are never allowed).
        stop_token_ids: the model's EOS tokens; a complete grammar allows only these, and a
            matcher terminates when it accepts one.
        cache_size: grammars kept.

    Attributes:
        num_compiled: grammars compiled (cache misses).
        num_cache_hits: compiles answered from the cache.
        compile_s: seconds spent compiling them (the backend's compile calls, not counting
            :attr:`backend_s`).
        hit_s: seconds spent answering the cache hits (the key and the lookup; no compile).
        backend_s: seconds spent building xgrammar's compiler (once: reads the vocabulary).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str, bool], Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()
        self._compiler: Any = None
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_s = 0.0
        self.hit_s = 0.0
        self.backend_s = 0.0

    def _backend(self) -> Any:
        """xgrammar's compiler, built on first use (reads the vocabulary: ~0.2 s for 49k)."""
        if self._compiler is None:
            t = time.perf_counter()
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self._stop_token_ids or None,
            )
            # Our own LRU caches whole grammars; xgrammar's cache would grow without bound.
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
            )
            self.backend_s = time.perf_counter() - t
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (from the cache when seen before).

        Raises:
            InvalidRequestError: the backend cannot compile it (an invalid or unsupported
                schema, regex or grammar); the message names ``structured_outputs.<field>``
                and gives xgrammar's reason.
        """
        t = time.perf_counter()
        key = spec.cache_key()
        hit = self._lookup(key, t)
        if hit is not None:
            return hit
        # One compile at a time (xgrammar's compiler uses threads of its own inside).
        with self._compile_lock:
            hit = self._lookup(key, time.perf_counter())  # compiled while this one waited
            if hit is not None:
                return hit
            self._backend()
            t = time.perf_counter()
            compiled = self._compile(spec, key)
            with self._lock:
                self.compile_s += time.perf_counter() - t
                self.num_compiled += 1
                self._cache[key] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return compiled

    def _lookup(self, key: tuple[str, str, bool], start: float) -> Any:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                self.hit_s += time.perf_counter() - start
            return hit

    def stats(self) -> dict[str, float]:
        """The counters above, as a dict (the bench's W1J trace reports them)."""
        with self._lock:
            return {
                "num_compiled": self.num_compiled,
                "num_cache_hits": self.num_cache_hits,
                "compile_s": self.compile_s,
                "hit_s": self.hit_s,
                "backend_s": self.backend_s,
            }

    def _compile(self, spec: StructuredOutputsParams, key: tuple[str, str, bool]) -> Any:
        kind, text, compact = key
        compiler = self._backend()
        try:
            if kind in ("json", "json_object"):
                schema = text if kind == "json" else '{"type": "object"}'
                grammar = _xgr().Grammar.from_json_schema(schema, any_whitespace=not compact)
                return compiler.compile_grammar(json_string_rules_fixed(str(grammar)))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                # JSON string literals are valid EBNF literals (same escapes).
                alternatives = " | ".join(_json_str(c) for c in spec.choice or ())
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(text)
        except RuntimeError as e:  # xgrammar reports every compile error as RuntimeError
            reason = _CPP_PREFIX.sub("", str(e).strip()).strip()
            raise InvalidRequestError(
                f"structured_outputs.{kind} cannot be compiled: {reason}"
            ) from None


#: xgrammar 0.2.9's rule for one character of a string with ``minLength``/``maxLength``
#: (mlc-ai/xgrammar#800): it lets raw control characters (U+0000-U+001F but CR and LF) into
#: the string, which RFC 8259 forbids, and no escape at all.
_LENGTH_STRING_CHAR = r"_characters ::= (([^\"\\\r\n]))"
#: RFC 8259's string character: unescaped (not a control character, quote or backslash) or
#: an escape; ``\u`` escapes of UTF-16 surrogates are left out, so that each character of
#: the grammar is one code point of the parsed string and the length bounds hold exactly.
_JSON_STRING_CHAR = (
    r'_characters ::= (([^\0-\x1f\"\\]) | ("\\" ([\"\\/bfnrt] | ("u" '
    r"(([0-9A-Ca-cEFef] [0-9A-Fa-f]) | ([Dd] [0-7])) [0-9A-Fa-f] [0-9A-Fa-f]))))"
)


def json_string_rules_fixed(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar of a JSON schema) with the character rule of its
    length-bounded strings replaced by RFC 8259's (:data:`_JSON_STRING_CHAR`): a strict
    JSON parser reads every output, and escapes count as one character each. A grammar
    without that rule (a later xgrammar) comes back as it is."""
    return ebnf.replace(_LENGTH_STRING_CHAR, _JSON_STRING_CHAR)


def tagged_json_grammar(
    schema: Mapping[str, Any], begin: str, end: str, separator: str, *, at_most_one: bool
) -> str:
    """EBNF text (xgrammar's syntax, ``root`` rule) for one or more ``begin JSON end`` blocks
    separated by ``separator``, each JSON value following ``schema``: the shape of tool calls
    in tagged formats (Hermes' ``<tool_call>\\n{...}\\n</tool_call>``). Built with
    xgrammar's structural tags (``tags_with_separator``, the format its own tool-call
    templates use) and printed as EBNF, so it travels as ``StructuredOutputsParams.grammar``
    and is cached by its text. Whitespace inside the JSON is at most one character per
    place (a random model cannot write whitespace forever).

    Args:
        schema: the JSON schema of each block's content.
        begin, end, separator: the literal text around and between blocks.
        at_most_one: exactly one block (else one or more).

    Raises:
        InvalidRequestError: xgrammar cannot convert the schema (its reason).
    """
    import json

    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    tag = {"type": "tag", "begin": begin, "content": content, "end": end}
    fmt = {
        "type": "tags_with_separator",
        "tags": [tag],
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": at_most_one,
    }
    try:
        grammar = _xgr().Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": fmt})
        )
    except RuntimeError as e:
        reason = _CPP_PREFIX.sub("", str(e).strip()).strip()
        raise InvalidRequestError(f"tool parameters cannot be compiled: {reason}") from None
    return json_string_rules_fixed(str(grammar))


def _json_str(s: str) -> str:
    import json

    return json.dumps(s, ensure_ascii=False)


class GrammarMatchers:
    """The grammar matchers of the constrained requests in an engine, by internal request id,
    and the step's token bitmask.

    Args:
        vocab_size: rows of the model's output layer.
        max_rows: the most rows a step samples (``max_num_seqs``).
    """

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, compiled: Any, stop_token_ids: Iterable[int]) -> None:
        """A fresh matcher of ``compiled`` for ``request_id`` (microseconds) whose stop tokens
        are ``stop_token_ids`` (the model's EOS and the request's own ``stop_token_ids``):
        each is masked until the grammar is complete and ends it there. A request's stop id
        may be an ordinary token (a letter) that the grammar would otherwise allow inside a
        JSON string, ending the request with "stop" and half a document (vLLM's #42403)."""
        self._matchers[request_id] = _xgr().GrammarMatcher(
            compiled, override_stop_tokens=sorted(stop_token_ids)
        )

    def free(self, request_ids: Iterable[str]) -> None:
        """Drop the matchers of finished requests (unknown ids are ignored)."""
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def fill(self, request_ids: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        """The token bitmask of a step whose sampled rows are ``request_ids`` (in row order):
        ``(bitmask [max_rows, ceil(vocab / 32)] int32 on CPU, the rows it constrains)``, or
        None when no row is constrained. Row ``i`` of the bitmask belongs to logits row ``i``.
        """
        if not self._matchers:
            return None
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(request_ids):
            xgr = _xgr()
            self._bitmask = xgr.allocate_token_bitmask(
                max(self.max_rows, len(request_ids)), self.vocab_size
            )
        for i in rows:
            self._matchers[request_ids[i]].fill_next_token_bitmask(self._bitmask, i)
        return self._bitmask, rows

    def accept(self, sampled: Mapping[str, int]) -> dict[str, RequestStatus]:
        """Advance the matchers of the sampled constrained requests by their tokens.

        Returns:
            request id -> how it must finish now: "stop" when its grammar is complete (the
            matcher accepted a stop token), "abort" when the token was not accepted (only
            possible if the mask was not applied; the output would be invalid).
        """
        finished: dict[str, RequestStatus] = {}
        for rid, token in sampled.items():
            matcher = self._matchers.get(rid)
            if matcher is None:
                continue
            if not matcher.accept_token(token):
                finished[rid] = RequestStatus.FINISHED_ABORTED
            elif matcher.is_terminated():
                finished[rid] = RequestStatus.FINISHED_STOPPED
        return finished


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose bit is 0 in the bitmask
    (xgrammar's kernel for the logits' device: C++ on CPU, CUDA/Triton on GPUs).

    Args:
        logits: ``[B, V]`` float32.
        bitmask: ``[>= B, ceil(V / 32)]`` int32 on CPU, as :meth:`GrammarMatchers.fill`.
        rows: the rows to mask.
    """
    xgr = _xgr()
    mask = bitmask[: logits.shape[0]]
    if logits.device.type != "cpu":
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], indices=rows)
