"""What a caller receives."""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct, frozen=True):
    """One token's log-probability at one position.

    Attributes:
        logprob: natural-log probability under the model's raw distribution (``log_softmax``
            of the logits, before bias, penalties and temperature).
        rank: 1-based rank of the token in that distribution (1 = most likely; the number
            of tokens whose log-probability is >= this one's, as vLLM counts).
        decoded_token: the token's own text: :attr:`token_bytes` decoded as UTF-8, with
            U+FFFD for a token that holds only part of a character (a byte token); special
            tokens give their content, and a sentencepiece ``"▁Hello"`` gives ``" Hello"``
            (its space, which ``decode([id])`` would strip).
        token_bytes: the token's raw bytes, from the tokenizer's own token-to-bytes mapping
            (``asyncllm.output_processing.detokenizer.token_bytes``): SmolLM2's byte-level
            token 177 is ``b"\\xe6"``, a ``<0xE6>`` byte-fallback token the same. Joined over a
            generation they are the UTF-8 of its text (plus the content of special tokens
            the text skips).
    """

    logprob: float
    rank: int
    decoded_token: str
    token_bytes: bytes


#: Per position: token id -> its :class:`Logprob`; the chosen (sampled, or prompt) token
#: first, then the requested top alternatives by rank.
PositionLogprobs = dict[int, Logprob]


class RequestMetrics(msgspec.Struct, kw_only=True):
    """Per-request timings (seconds, from ``time.monotonic()``) and token counts.

    Attributes:
        arrival_time: when the call was made (``time.monotonic()``).
        queue_time: first scheduled - arrival; None when it was never scheduled.
        ttft: time to first token: first token delivered to the front end - arrival; None
            when no token was generated.
        mean_tpot: mean time per output token after the first: (last token - first token)
            / (tokens - 1); None with fewer than two tokens.
        e2e_latency: finish - arrival.
        num_prompt_tokens: tokens in the prompt.
        num_cached_tokens: prompt tokens served from the prefix cache (not computed).
        num_generated_tokens: tokens generated.
        num_preemptions: times the request was preempted (swapped out or recomputed).
    """

    arrival_time: float
    queue_time: float | None
    ttft: float | None
    mean_tpot: float | None
    e2e_latency: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    num_preemptions: int = 0


class ToolCall(msgspec.Struct, frozen=True):
    """A tool call the model made (parsed from its output by ``AsyncEngine.chat`` when
    given ``tools``; see ``asyncllm.tool_calling.tool_calls``).

    Attributes:
        id: a fresh id, ``"call_"`` and 24 hex digits (OpenAI's shape); send it back as the
            ``tool_call_id`` of the ``role: "tool"`` message that answers the call.
        name: the function's name, as the model wrote it.
        arguments: the arguments as a JSON object text (OpenAI's ``function.arguments``).
    """

    id: str
    name: str
    arguments: str


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A piece of a tool call as it is generated (vLLM's ``DeltaToolCall``, OpenAI's
    streamed ``delta.tool_calls[]`` item): the first piece of call ``index`` has its ``id``
    and ``name`` (and ``arguments`` ""), the later ones ``arguments`` text only.

    Joined in order, a call's ``arguments`` pieces equal its :attr:`ToolCall.arguments`
    (the same id, delivered whole on the item that completes the call). A call whose text
    turns out malformed after its first pieces were sent is not delivered as a
    :class:`ToolCall` (see :attr:`RequestOutput.tool_call_error`); its index is not reused.

    Attributes:
        index: the call's position among the sample's calls (0-based).
        id: the call's id, on its first piece; None after.
        name: the function's name, on its first piece; None after.
        arguments: the next characters of the arguments JSON text.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class RequestOutput(msgspec.Struct, kw_only=True):
    """One item of a stream, or the whole result of ``generate()``.

    With ``output_kind="delta"`` (the default) ``token_ids``, ``text`` and ``logprobs`` of a
    streamed item hold what is new since the previous item (a slow reader gets several steps
    merged into one item); with "cumulative" they hold everything so far; with "final" the
    stream has one item, the last. ``generate()`` always returns the whole output.

    Attributes:
        request_id: the request's id.
        token_ids: generated token ids (a matched stop string's tokens included).
        text: their text: an item never ends inside a multi-byte character (a request that
            stops mid-character, at ``max_tokens``, leaves that character's bytes out rather
            than end with U+FFFD), never ends with text that could still become a stop
            string, and leaves out the matched stop string (and a stop token's text) unless
            ``include_stop_str_in_output``.
        finish_reason: None while running, then "stop" (EOS, a stop token or a stop string),
            "tool_calls" (``chat`` with tools: the model stopped after making tool calls,
            as OpenAI reports it), "length" (max_tokens or max_model_len reached), "abort"
            (the caller aborted, or the engine shut down with ``shutdown_mode="abort"``) or
            "timeout" (the request's ``timeout`` passed, or its ``deadline`` before it
            started).
        stop_reason: with finish_reason "stop": the matched stop string, or the stop token
            id from ``stop_token_ids``; None for EOS.
        num_prompt_tokens: tokens in the prompt.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_generated_tokens: tokens generated so far in total.
        logprobs: with ``SamplingParams.logprobs``: one dict per token of ``token_ids``.
        cumulative_logprob: with ``logprobs``: the sum of the generated tokens' logprobs so
            far.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: one entry per prompt token
            (None for the first), on the first item of a stream (every item when
            "cumulative").
        index: which of the request's ``n`` parallel samples this item belongs to.
        prompt_token_ids: the prompt's token ids, on the last item.
        metrics: timings and counts, on the last item.
        samples: from ``generate()`` with ``n > 1``: all n outputs in index order (this
            output is ``samples[0]``); None otherwise.
        tool_calls: from ``chat(..., tools=...)``: the tool calls parsed from the output
            (``text`` then holds only the content outside them); on a delta item the calls
            completed in it, on a cumulative or final item all of them. None when there are
            none or no tools were given.
        tool_call_error: from ``chat(..., tools=...)``, on the last item: None, or what was
            wrong with the model's tool calls (malformed JSON, no call where
            ``tool_choice`` asked for one); the text in question is kept in ``text``.
        tool_call_deltas: from ``chat(..., tools=...)`` with ``output_kind="delta"``: the
            pieces of tool calls generated in this item (:class:`ToolCallDelta`: a call's
            id and name as soon as its name is complete, then its arguments text as it
            grows, as OpenAI streams ``delta.tool_calls``); None when there are none, and
            always with other output kinds.
        reasoning: from ``chat`` with a thinking model's template (``<think>...</think>``,
            :mod:`asyncllm.tool_calling.reasoning`): the reasoning text, split from ``text``
            (which then holds only the answer); new text on a delta item, all of it so far
            otherwise. None when there is none.
        queue_position: with ``report_queue=True``, on the items a stream gets before its
            request starts (no tokens, ``text`` ""): how many requests will start before it
            (0: it is next), each time that changes. None otherwise.
        estimated_start_s: with ``queue_position``: seconds from now until it starts, from
            the rate at which requests started recently (None until that rate is known).
    """

    request_id: str
    index: int = 0
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_token_ids: list[int] | None = None
    metrics: RequestMetrics | None = None
    samples: list[RequestOutput] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_error: str | None = None
    tool_call_deltas: list[ToolCallDelta] | None = None
    reasoning: str | None = None
    queue_position: int | None = None
    estimated_start_s: float | None = None

    @property
    def finished(self) -> bool:
        """True on the last item of a request."""
        return self.finish_reason is not None
