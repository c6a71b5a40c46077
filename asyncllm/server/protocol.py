"""The OpenAI request bodies the server accepts and their mapping to :class:`SamplingParams`
(the JSON objects it answers with are in :mod:`asyncllm.server.responses`).

Bodies are decoded with msgspec into the structs below. Fields follow OpenAI's API reference
(``/v1/completions``, ``/v1/chat/completions``); unknown fields are ignored (as vLLM does).
The extra sampling fields vLLM accepts (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``) and the engine's ``priority`` and ``cache_salt`` are accepted too;
with the ``openai`` client pass them in ``extra_body``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncllm.errors import EngineDeadError, EngineNotRunningError, InvalidRequestError, QueueFull
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams
from asyncllm.server.responses import ErrorBody, ErrorInfo
from asyncllm.tool_calling import tool_calls

logger = logging.getLogger("asyncllm.server")

#: The most choices one request may ask for (``n`` times the number of prompts).
MAX_CHOICES = 128
#: OpenAI's ``logprobs`` limit on /v1/completions is 5; the engine allows up to 20.
MAX_COMPLETION_LOGPROBS = 20


class APIError(Exception):
    """An error answered as OpenAI's error JSON ``{"error": {"message", "type", "param",
    "code"}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> ErrorBody:
        """The JSON body."""
        return ErrorBody(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


ENGINE_FAILED = "the engine failed and serves no more requests; the server log has the details"
ENGINE_STOPPED = "the engine is not running"
INTERNAL_ERROR = "internal server error; the server log has the details"


def api_error(exc: BaseException) -> APIError:
    """Map an exception to the error the client sees.

    Only messages written for clients are passed on (:class:`APIError`, our typed input
    errors, :class:`QueueFull`); an engine failure or an unexpected exception gets a fixed
    message (the exception, which may name internals such as files or the failed step,
    goes to the server log), so no response carries a Python repr, a qualified name or a
    path.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        logger.info("request refused: %s", exc)
        return APIError(
            "the server's waiting queue is full; try again later",
            429,
            type="rate_limit_error",
            code="rate_limit_exceeded",
        )
    if isinstance(exc, EngineDeadError):
        logger.warning("request failed: the engine is dead: %s", exc)
        return APIError(ENGINE_FAILED, 503, type="server_error", code="engine_unavailable")
    if isinstance(exc, EngineNotRunningError):
        return APIError(ENGINE_STOPPED, 503, type="server_error", code="engine_unavailable")
    if isinstance(exc, RecursionError):  # a deeply nested value from the body
        return APIError("the request is nested too deeply")
    if isinstance(exc, (InvalidRequestError, ValueError)):
        # A grammar the engine cannot compile came from the request's response_format.
        grammar = isinstance(exc, InvalidRequestError) and str(exc).startswith("structured_outputs")
        return APIError(str(exc), 400, param="response_format" if grammar else None)
    logger.error("unexpected error in a request", exc_info=exc)
    return APIError(INTERNAL_ERROR, 500, type="server_error")


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` (and empty
    ``choices``) before ``data: [DONE]``."""

    include_usage: bool | None = False


class _RequestBase(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Unknown top-level fields are refused, as OpenAI does ("Unrecognized request argument
    # supplied: ..."): a misspelt option must not vanish without a word.
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters and the engine's request options.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_RequestBase, kw_only=True):
    """A ``/v1/completions`` body. ``prompt``: a string, a list of strings (one choice per
    prompt and sample), token ids, or a list of token-id lists."""

    prompt: str | list[Any]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_RequestBase, kw_only=True):
    """A ``/v1/chat/completions`` body. ``logprobs`` is a bool and ``top_logprobs`` the
    number of alternatives.
    ``chat_template_kwargs`` (template variables only, see :func:`chat_template_kwargs`)
    and ``add_generation_prompt`` are passed to the chat template; ``chat_template``
    replaces the model's only on a server started with ``--trust-request-chat-template``
    (vLLM's extensions). ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are
    OpenAI's (see :func:`check_tools`)."""

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    chat_template: str | None = None


def check_tools(req: ChatCompletionRequest) -> None:
    """Check ``tools`` and ``tool_choice`` (``asyncllm.tool_calling.tool_calls``) before the
    request reaches the engine.

    Raises:
        APIError: 400 naming the field: a malformed tool (``tools[i].function.parameters``
            that is not a JSON schema of an object...), a ``tool_choice`` naming a
            function no tool has, "required" without tools.
    """
    try:
        tools = tool_calls.check_tools(req.tools) if req.tools is not None else None
    except InvalidRequestError as e:
        raise APIError(str(e), param="tools") from None
    try:
        tool_calls.check_tool_choice(req.tool_choice, tools)
    except InvalidRequestError as e:
        raise APIError(str(e), param="tool_choice") from None


def requested_max_tokens(req: _RequestBase) -> tuple[int | None, str]:
    """The body's token limit and the field it came from: ``max_completion_tokens`` (OpenAI's
    current name, on both endpoints) wins over the older ``max_tokens``."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


_PARAM_AT = re.compile(r"at `\$\.([A-Za-z_]+)")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `([^`]*)`$")
_PARAM_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


#: The deepest nesting of arrays and objects a request body may have, in any field (ignored
#: ones included). An explicit bound: msgspec's own is Python's recursion limit, which
#: libraries raise process-wide (Inductor sets at least 2,000 when it compiles), and deeper
#: nesting recurses deeper in C.
MAX_NESTING = 512

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def too_deep(body: bytes, limit: int = MAX_NESTING) -> bool:
    """Whether the JSON text ``body`` nests arrays and objects more than ``limit`` deep
    (brackets inside strings do not count). One count for a body with at most ``limit``
    opening brackets (the usual one); else a scan of its brackets, linear in their count
    (docs/tuning.md, "Costs behind smaller code choices")."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for b in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET):
        if b == 91 or b == 123:  # [ {
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode a JSON body into ``kind``.

    Raises:
        APIError: 400 for anything but a JSON object of the right field types: malformed
            JSON, invalid UTF-8, an empty body, another JSON type (an array...), a field of
            the wrong type (``param`` names it), or nesting deeper than :data:`MAX_NESTING`
            levels (in any field, ignored ones included).
    """
    if too_deep(body):
        raise APIError(f"the request body is nested more than {MAX_NESTING} levels deep")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        unknown = _UNKNOWN_FIELD.match(msg)  # a top-level one (nested ones say where)
        if unknown:
            raise APIError(f"Unrecognized request argument supplied: {unknown.group(1)}") from None
        m = _PARAM_AT.search(msg) or _PARAM_MISSING.search(msg)
        raise APIError(msg, param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None


_SP_FIELDS = frozenset(SamplingParams.__struct_fields__)


def _sampling_error(e: ValueError, rename: Mapping[str, str]) -> APIError:
    """An InvalidRequestError from SamplingParams names its field first."""
    msg = str(e)
    head = re.match(r"[A-Za-z_]+", msg)
    param = head.group(0) if head and head.group(0) in _SP_FIELDS else None
    if param is not None:
        param = rename.get(param, param)
    return APIError(msg, param=param)


def structured_outputs(response_format: Mapping[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as :class:`StructuredOutputsParams`: ``{"type": "text"}``
    (or none) is unconstrained, ``{"type": "json_object"}`` any JSON object, and
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
    the schema (vLLM's mapping; ``strict`` is accepted and the schema always enforced).

    Raises:
        APIError: 400 (``param`` "response_format") for another type or a malformed
            ``json_schema``. Whether the schema compiles is checked by the engine.
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise APIError(
            "response_format type must be 'text', 'json_object' or 'json_schema', got "
            + (repr(kind[:50]) if isinstance(kind, str) else "a non-string"),
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise APIError(
            "response_format json_schema must be an object with a str 'name' and a 'schema' object",
            param="response_format",
        )
    schema = spec.get("schema", {})  # OpenAI: no schema means any JSON
    if not isinstance(schema, Mapping):
        raise APIError(
            "response_format json_schema.schema must be an object", param="response_format"
        )
    return StructuredOutputsParams(json=dict(schema))


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    n: int,
    max_tokens: int | None,
    logprobs: int | None,
    rename: Mapping[str, str] | None = None,
) -> SamplingParams:
    """The request's :class:`SamplingParams` (OpenAI's defaults where a field is absent:
    temperature 1, top_p 1, no penalties).

    Args:
        n: samples per prompt (the engine's parallel sampling).
        max_tokens: already resolved (the endpoint's default applied).
        logprobs: alternatives per token, or None.
        rename: SamplingParams field -> the request's name for it, for error ``param``.

    Raises:
        APIError: 400 naming the field.
    """
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "logit_bias": req.logit_bias,
        "logprobs": logprobs,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "structured_outputs": structured_outputs(req.response_format),
    }
    kwargs = {k: v for k, v in fields.items() if v is not None}
    kwargs["max_tokens"] = max_tokens  # None means "until max_model_len"
    if n != 1:
        if "n" not in _SP_FIELDS:
            raise APIError("n > 1 is not supported by this engine", param="n")
        kwargs["n"] = n
    try:
        return SamplingParams(**kwargs, output_kind="delta")
    except (InvalidRequestError, ValueError, TypeError) as e:
        rename = {"structured_outputs": "response_format", **(rename or {})}
        raise _sampling_error(ValueError(str(e)), rename) from None


def check_common(req: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> int:
    """Check ``n`` (>= 1, at most :data:`MAX_CHOICES` choices in all); returns it."""
    n = 1 if req.n is None else req.n
    if n < 1:
        raise APIError(f"n must be >= 1, got {n}", param="n")
    if n * num_prompts > MAX_CHOICES:
        raise APIError(
            f"n x the number of prompts must be <= {MAX_CHOICES}, got {n * num_prompts}",
            param="n",
        )
    return n


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: strings or token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        for p in prompt
    ):
        return [list(p) for p in prompt]
    raise APIError(
        "prompt must be a string, a list of strings, a list of token ids, or a list of "
        "token-id lists",
        param="prompt",
    )


#: The message roles OpenAI's chat API accepts (others: 400, ``code`` "invalid_value").
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template expects them: text parts joined into one
    string, the "developer" role as "system".

    Raises:
        APIError: 400 (``param`` "messages") for an empty list, a message without a string
            ``role``, content that is not a string, a list of text parts or null, or a
            part that is not ``{"type": "text", "text": str}``; a role that is not one of
            :data:`ROLES` (``param`` "messages[i].role", as OpenAI answers).
    """
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}].role must be a string", param="messages")
        if m["role"] not in ROLES:
            raise APIError(
                f"Invalid value: {m['role'][:40]!r}. Supported values are: "
                + ", ".join(repr(r) for r in ROLES[:-1])
                + f" and {ROLES[-1]!r}.",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
        if m["role"] == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text":
                    shown = repr(kind) if isinstance(kind, str) else "a part without a type"
                    raise APIError(
                        f"only text content parts are supported, got {shown}",
                        param="messages",
                    )
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise APIError(
                        f"messages[{i}].content: a text part's text must be a string",
                        param="messages",
                    )
                texts.append(text)
            m["content"] = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise APIError(
                f"messages[{i}].content must be a string, a list of text parts or null",
                param="messages",
            )
        out.append(m)
    return out


#: ``apply_chat_template`` options that are not template variables: a request may not set
#: them through ``chat_template_kwargs``, since they change what the server does rather
#: than what the template renders (the template itself, tokenization and return type,
#: truncation, tools and documents, which have fields of their own). Transformers' own
#: signature adds any further named parameter (see :func:`reserved_template_options`).
RESERVED_TEMPLATE_OPTIONS = frozenset(
    {
        "conversation", "messages", "chat_template", "tools", "documents",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
        "sanitize_control_tokens", "kwargs",
    }
)  # fmt: skip


def reserved_template_options(tokenizer: Any) -> frozenset[str]:
    """:data:`RESERVED_TEMPLATE_OPTIONS` plus every named parameter of this tokenizer's
    ``apply_chat_template`` (so a newer transformers' options are refused too)."""
    names = set(RESERVED_TEMPLATE_OPTIONS)
    method = getattr(tokenizer, "apply_chat_template", None)
    if method is not None:
        with contextlib.suppress(TypeError, ValueError):
            for name, param in inspect.signature(method).parameters.items():
                if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                    names.add(name)
    return frozenset(names)


def chat_template_kwargs(
    req: ChatCompletionRequest,
    reserved: frozenset[str],
    *,
    trust_template: bool,
    server_template: str | None = None,
) -> dict[str, Any] | None:
    """The template arguments of a chat request.

    ``chat_template_kwargs`` may hold template variables only (``enable_thinking``...). A
    request's own template (the top-level ``chat_template`` field, or that key of
    ``chat_template_kwargs``) is a program the server would run, so it is taken only when
    the server trusts request templates (vLLM's ``--trust-request-chat-template``).

    Args:
        req: the request.
        reserved: keys that are not template variables (:func:`reserved_template_options`).
        trust_template: accept a request's ``chat_template``.
        server_template: the server's own template (``serve --chat-template``), used when
            the request brings none; None: the model's.

    Returns:
        The ``chat_template_kwargs`` to pass to the engine (with ``chat_template`` when
        trusted and given, else the server's), or None.

    Raises:
        APIError: 400 naming the field: a template the server does not trust, two
            templates, or a reserved key in ``chat_template_kwargs``.
    """
    kwargs = dict(req.chat_template_kwargs or {})
    template = req.chat_template
    param = "chat_template"
    if "chat_template" in kwargs:
        if template is not None:
            raise APIError(
                "give chat_template once (top level or in chat_template_kwargs)", param=param
            )
        template = kwargs.pop("chat_template")
        param = "chat_template_kwargs"
    if template is not None:
        if not trust_template:
            raise APIError(
                "this server does not run chat templates sent in requests (its operator "
                "can allow them with --trust-request-chat-template)",
                param=param,
            )
        if not isinstance(template, str):
            raise APIError("chat_template must be a string", param=param)
    bad = sorted(k for k in kwargs if k in reserved)
    if bad:
        raise APIError(
            "chat_template_kwargs may hold only template variables, not " + ", ".join(bad),
            param="chat_template_kwargs",
        )
    if template is None:
        template = server_template
    if template is not None:
        kwargs["chat_template"] = template
    return kwargs or None
