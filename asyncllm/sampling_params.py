"""Per-request sampling parameters.

Fields, names and defaults follow vLLM's ``SamplingParams`` (which follows the OpenAI API).
Every field is checked on construction (and on
``msgspec`` decoding); an invalid value raises
:class:`~asyncllm.errors.InvalidRequestError` (a ``ValueError``) whose message starts with the
field's name and states the allowed range. Token ids are checked against the model's
vocabulary when the request is made (the params do not know the model).

How the logits of one step become a token (:mod:`asyncllm.worker.sampling.sampler`), in
vLLM's order:

1. ``logprobs`` / ``prompt_logprobs`` are read from the model's raw logits
   (``log_softmax`` before anything below, vLLM's default ``logprobs_mode="raw_logprobs"``).
2. ``logit_bias`` is added; while fewer than ``min_tokens`` tokens are generated the EOS and
   ``stop_token_ids`` logits are set to -inf.
3. Penalties (definitions below) are applied.
4. ``structured_outputs``: tokens the request's grammar does not allow next are set to -inf
   (xgrammar's token bitmask), so that nothing below can pick them.
5. Greedy rows (``temperature`` < 1e-5, or ``top_k`` == 1) take the argmax here; the others
   divide by ``temperature``, then apply ``min_p``, ``top_k``, ``top_p`` and draw.

Penalties, with ``l[v]`` the logit of token ``v`` and ``c[v]`` how often ``v`` occurs among
the tokens generated so far:

* ``repetition_penalty`` ``r`` (Keskar et al., 2019, "CTRL", Sec. 4.1, in the form of
  transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM): for every ``v`` in the prompt
  or the output, ``l[v] = l[v] / r`` if ``l[v] > 0`` else ``l[v] * r``. ``r > 1`` discourages
  repeats, ``r < 1`` encourages them; 1 is off.
* ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI API reference,
  "Parameter details"; vLLM): ``l[v] = l[v] - c[v] * f - (c[v] > 0) * p``, output tokens
  only. Positive values discourage repeats; 0 is off.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from asyncllm.errors import InvalidRequestError

#: The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for (vLLM's default
#: ``max_logprobs``).
MAX_LOGPROBS = 20
#: Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE_EPS = 1e-5
#: The range of a ``logit_bias`` value (OpenAI's).
MAX_LOGIT_BIAS = 100.0
OUTPUT_KINDS = ("delta", "cumulative", "final")
#: The largest top_k (values above the vocabulary mean "all tokens" like 0).
MAX_TOP_K = 2**31 - 1
#: The most parallel samples one request may ask for.
MAX_N = 256
#: The most stop strings one request may give. Each is searched for in every text delta of
#: every sample on the event loop (350,000 of them, with n=8, stalled a server's loop for
#: over 5 s per step); TGI's ``--max-stop-sequences`` caps them likewise (default 4, as
#: OpenAI's API).
MAX_STOP_STRINGS = 64

OutputKind = Literal["delta", "cumulative", "final"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not _is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidRequestError(f"{name} must be {rng}, got {value}")


def _float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not (v > lo if lo_open else v >= lo) or v > hi or math.isnan(v):
        left = "(" if lo_open else "["
        raise InvalidRequestError(f"{name} must be in {left}{lo}, {hi}], got {value!r}")
    return v


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a bool, got {value!r}")


def _token_id(name: str, value: object) -> int:
    if isinstance(value, str):  # JSON object keys (OpenAI clients send {"50256": -100})
        if not (value.isascii() and value.isdigit()):
            raise InvalidRequestError(
                f"{name} keys must be token ids (integers >= 0), got {value!r}"
            )
        value = int(value)
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise InvalidRequestError(f"{name} must hold token ids (integers >= 0), got {value!r}")
    return value  # type: ignore[return-value]


#: The fields of :class:`StructuredOutputsParams` of which exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Constrain a request's output to a JSON schema, any JSON object, a regex, one of a
    list of strings, or an EBNF grammar (vLLM's ``StructuredOutputsParams``, the same field
    names). Exactly one of the five is set.

    Decoding masks, at every step, the tokens that cannot continue a valid output (xgrammar,
    the grammar engine of vLLM and SGLang: https://github.com/mlc-ai/xgrammar); when the
    grammar is complete only EOS is allowed, and the request ends with finish_reason "stop"
    (or "length" if ``max_tokens`` comes first: the output is then a valid prefix only). The
    request's own ``stop_token_ids`` are masked until the grammar is complete (then they
    end it like EOS), so an ordinary token among them never cuts a document short. JSON
    output is RFC 8259 JSON for a strict parser (no raw control character in a string).

    Attributes:
        json: a JSON schema (a dict, or its JSON text). Properties are generated in the
            schema's order; properties the schema does not list are not generated (xgrammar's
            strict mode, as vLLM).
        json_object: True: any JSON object (OpenAI's ``response_format`` "json_object").
        regex: a regular expression the whole output matches (xgrammar's dialect: no
            lookaround, no backreferences, no word boundaries).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar in xgrammar's (GBNF-like) syntax with a ``root`` rule.
        disable_any_whitespace: JSON (``json``, ``json_object``) in one fixed layout, on one
            line (``{"a": 1, "b": [2, 3]}``); by default any whitespace may appear between
            JSON tokens (a model may then write whitespace until ``max_tokens``).

    Raises:
        InvalidRequestError: not exactly one kind set, a field of the wrong type, or a
            ``json`` text that is not JSON; the message names the field. Whether the
            backend can compile the grammar is checked when the request is submitted
            (a schema, regex or grammar it cannot compile: InvalidRequestError naming
            ``structured_outputs.<field>``).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Validate the fields (see the class docstring)."""
        name = "structured_outputs"
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                f"{name} must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                f"got {set_kinds or 'none'}"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidRequestError(f"{name}.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    f"{name}.json must be a JSON schema (an object), got {self.json!r:.100}"
                )
        if self.json_object is not None:
            _bool(f"{name}.json_object", self.json_object)
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name}.{field} must be a non-empty str, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError(
                f"{name}.choice must be a non-empty list of str, got {self.choice!r:.100}"
            )
        _bool(f"{name}.disable_any_whitespace", self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        """The field that is set: one of :data:`STRUCTURED_OUTPUT_KINDS`."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """``(kind, text, disable_any_whitespace)``: equal for requests that compile to the
        same grammar (a schema dict by its JSON text, properties in order)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(list(value), ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, self.disable_any_whitespace


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one request's tokens, when to stop, and what to return.

    Attributes:
        n: parallel samples of the prompt, sharing its KV blocks (``stream()`` tags each
            item with its sample ``index``). Sample ``i`` samples as a separate request with
            ``seed + i`` (mod 2**64, within the seed range) would. Range [1, 256].
        max_tokens: the most tokens to generate, >= 1; None: until ``max_model_len``.
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled, and stop strings are not
            matched, until this many tokens are generated. Range [0, max_tokens].
        temperature: logits are divided by it before sampling; below 1e-5 (0 included) the
            request is greedy (argmax after bias and penalties; its seed is unused).
            Range [0, 100].
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p
            (nucleus sampling, Holtzman et al., ICLR 2020). Range (0, 1].
        top_k: keep only the k most likely tokens; 0 or -1: all. Range [-1, 2**31 - 1]
            (-1 is stored as 0).
        min_p: keep tokens whose probability is at least ``min_p`` times the most likely
            token's, after temperature (Nguyen et al., 2024, "Turning Up the Heat: Min-p
            Sampling"). Range [0, 1]; 0 is off.
        presence_penalty: subtracted once from the logit of every token already generated
            (see the module docstring). Range [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time it was generated.
            Range [-2, 2].
        repetition_penalty: divides positive / multiplies negative logits of tokens in the
            prompt or the output (CTRL). Range (0, 100]; 1 is off.
        seed: gives the request its own random stream, whatever else shares its batches
            (see :mod:`asyncllm.worker.sampling.pick`). Its samples repeat exactly where the
            logits do: in float32; in bfloat16 and with int4 weights the kernels depend on
            the batch's row count (and a prefix-cache hit computes fewer rows), so the
            logits move by up to ~0.1 and a sample near a boundary can differ (as in vLLM).
            Range [-2**63, 2**64 - 1]; None: the engine's generator.
        stop: strings that end generation when they appear in the output text, matched
            across token boundaries; stored as a list (a str is one stop string). The text
            of a stream is held back while it could be the start of a stop string. Each
            must be a non-empty str; at most ``MAX_STOP_STRINGS`` (64) of them.
        stop_token_ids: token ids that end generation like EOS (finish_reason "stop",
            ``stop_reason`` the id). Each >= 0 and in the vocabulary. Stored as a list.
        include_stop_str_in_output: keep the matched stop string (or the stop token's
            text) at the end of the output text; by default it is left out.
        ignore_eos: keep generating past the model's EOS tokens (``stop_token_ids`` still
            stop).
        logprobs: return, for every generated token, its log-probability and those of the
            ``logprobs`` most likely alternatives (0: the sampled token only). Values are
            the model's raw ``log_softmax`` before bias, penalties and temperature. Range
            [0, 20]; None: none.
        prompt_logprobs: the same for each prompt token after the first (the first has no
            context, its entry is None). Range [0, 20]; None: none.
        logit_bias: token id -> value added to its logit before sampling (OpenAI's
            ``logit_bias``). Values in [-100, 100]; +100 practically forces a token, -100
            bans it. Keys may be ints or strings of ints (JSON).
        skip_special_tokens: leave special tokens out of the text (token ids keep them).
        output_kind: what each streamed item holds: "delta" (what is new since the
            previous item), "cumulative" (everything so far) or "final" (one item, at the
            end, with everything).
        structured_outputs: constrain the output to a JSON schema, a regex, a choice or a
            grammar (:class:`StructuredOutputsParams`; a dict is converted to one). Each
            parallel sample follows the grammar on its own. ``logprobs`` stay the model's
            raw ones (tokens the grammar masks keep their logprob). None: unconstrained.

    Raises:
        InvalidRequestError: a field of the wrong type or outside its range; the message
            names the field.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    output_kind: OutputKind = "delta"
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens)
        self.temperature = _float("temperature", self.temperature, 0.0, 100.0)
        self.top_p = _float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _int("top_k", self.top_k, -1, MAX_TOP_K)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True
        )
        if self.seed is not None:
            _int("seed", self.seed, -(2**63), 2**64 - 1)
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_ids(self.stop_token_ids)
        _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _bool("ignore_eos", self.ignore_eos)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, MAX_LOGPROBS)
        self.logit_bias = self._check_bias(self.logit_bias)
        _bool("skip_special_tokens", self.skip_special_tokens)
        if not isinstance(self.output_kind, str) or self.output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError(
                f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}"
            )
        self.structured_outputs = self._check_structured(self.structured_outputs)

    @staticmethod
    def _check_structured(value: object) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, StructuredOutputsParams):
            if value is not None:
                value.check()  # a field may have been set since construction
            return value
        if not isinstance(value, Mapping):
            raise InvalidRequestError(
                f"structured_outputs must be StructuredOutputsParams or a dict, got {value!r:.100}"
            )
        try:
            return msgspec.convert(dict(value), StructuredOutputsParams)
        except msgspec.ValidationError as e:
            raise InvalidRequestError(f"structured_outputs: {e}") from None

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise InvalidRequestError(f"stop must be a str or a list of str, got {stop!r}")
        if len(items) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop holds {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed"
            )
        for s in items:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}")
        return list(items)

    @staticmethod
    def _check_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {ids!r}")
        return [_token_id("stop_token_ids", t) for t in ids]

    @staticmethod
    def _check_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise InvalidRequestError(f"logit_bias must be a dict, got {bias!r}")
        out: dict[int, float] = {}
        for k, v in bias.items():
            tid = _token_id("logit_bias", k)
            out[tid] = _float(f"logit_bias[{k!r}]", v, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        return out or None

    def sample_params(self, index: int) -> SamplingParams:
        """The parameters of parallel sample ``index``: ``n=1`` and the derived seed."""
        seed = self.seed
        if seed is not None:
            seed += index
            if seed > 2**64 - 1:
                seed -= 2**64
        return msgspec.structs.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (of the biased, penalized logits)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties is on."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (always a list after construction)."""
        return self.stop if isinstance(self.stop, list) else []
