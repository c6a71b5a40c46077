"""An OpenAI-compatible HTTP server over :class:`~asyncllm.AsyncEngine`.

Install the ``server`` extra (starlette, uvicorn, prometheus-client):
``pip install 'asyncllm[server]'``. Then, from the command line::

    python -m asyncllm serve --model default --host 127.0.0.1 --port 8000

Every :class:`~asyncllm.EngineConfig` field is an option of the same name (e.g.
``--max-num-seqs 16 --quantization int8``; ``serve --help`` lists them). Or in code, as any
ASGI app (its lifespan starts and stops the engine)::

    app = create_app(AsyncEngine.from_pretrained("default"), served_model_name="smollm2")
    uvicorn.run(app, host="127.0.0.1", port=8000)

With ``--replicas N`` (the ``ray`` extra) the same app runs on Ray Serve in front of N
replicas, with prefix-cache-aware routing (:mod:`asyncllm.integrations.ray_serve`,
docs/scaling.md).

Any OpenAI client works against it::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="default", messages=[...], stream=True)

Security (each ``serve`` option is also a keyword of :func:`create_app`, underscores for
dashes):

- ``--api-key KEY`` (repeat it, or separate keys with commas; without it the
  ``ASYNCLLM_API_KEY`` environment variable, comma-separated; ``create_app(api_keys=...)``):
  every route but ``/health`` requires ``Authorization: Bearer KEY`` (OpenAI clients send
  their ``api_key`` so), else 401 ``invalid_api_key``. Keys are compared in constant time
  (``hmac.compare_digest``, against every key). ``/metrics`` too, unless
  ``--metrics-without-auth``. Without keys the server is open to whoever reaches it: keep
  the default ``--host 127.0.0.1``.
- ``--max-request-bytes N`` (default 4 MiB): a larger body answers 413
  ``request_too_large``; the body is read in chunks and reading stops at the limit, whatever
  ``Content-Length`` says or when it is absent.
- POST bodies must be ``Content-Type: application/json`` (parameters such as ``charset``
  allowed), else 415 ``unsupported_media_type``: a web page cannot make a browser post to
  the server without a CORS preflight. ``--allowed-origins ORIGIN`` (repeat it or
  comma-separate; ``*`` for any) lets browser pages from those origins call the server
  (Starlette's ``CORSMiddleware``); none by default.
- ``--trust-request-chat-template``: without it (the default) a request's own
  ``chat_template`` (top level or in ``chat_template_kwargs``) answers 400, since a template
  is a program the server runs (as vLLM's flag of the same name).
- ``--client-priority-range MIN,MAX`` (``MIN <= 0 <= MAX``; write
  ``--client-priority-range=-5,5`` for a negative MIN): the ``priority`` values a request
  may ask for (lower is served first), else 400 naming the range. The default ``0,0`` lets
  no client jump ahead of others.
- Prefix-cache isolation: with API keys, requests made with different keys never share
  prefix-cache blocks (each key's requests get a ``cache_salt`` derived from a SHA-256
  digest of the key, combined with any ``cache_salt`` the request sends), since a prefix
  hit's speed tells a client about other clients' prompts.
  ``--share-prefix-cache-across-keys`` shares them (more hits, less isolation).

Endpoints:

- ``GET /v1/models``, ``GET /v1/models/{id}``: the one served model (its ``id`` is
  ``--served-model-name``, default the base name of the ``--model`` directory or file, or
  the ``--model`` value, e.g. "default"; also ``max_model_len``).
- ``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids or a list
  of token-id lists (one choice per prompt and sample, index = prompt x n + sample).
  ``max_completion_tokens`` (or ``max_tokens``) defaults to 16. ``echo`` prepends the
  prompt; ``logprobs`` (0-20) returns OpenAI's legacy logprobs object. ``suffix``, and
  ``echo`` with ``logprobs``, answer 400.
- ``response_format`` (both generation endpoints): ``{"type": "text"}`` (the default),
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}`` constrains decoding (``SamplingParams.structured_outputs``,
  xgrammar); a complete document ends with ``finish_reason`` "stop", one cut by
  ``max_tokens`` with "length". Another type, a malformed ``json_schema`` or a schema the
  grammar engine cannot compile answers 400 with ``param`` "response_format".
- ``POST /v1/chat/completions``: ``messages`` are rendered by the model's chat template, or
  the one ``--chat-template`` names (text content parts are joined; the "developer" role is
  sent as "system"; a role other than OpenAI's system, developer, user, assistant, tool and
  function answers 400, ``param`` "messages[i].role", ``code`` "invalid_value");
  ``max_completion_tokens`` (or ``max_tokens``) defaults to the rest of ``max_model_len``;
  ``logprobs`` with ``top_logprobs`` (0-20). Tool calling as OpenAI's: ``tools`` (function
  tools; a malformed one, e.g. ``parameters`` that is not a JSON schema of an object, answers
  400 with ``param`` "tools"), ``tool_choice`` ("auto", "none", "required" or a named function;
  a name no tool has answers 400, ``param`` "tool_choice") and ``parallel_tool_calls``; the
  conversation may hold assistant messages with ``tool_calls`` and ``role: "tool"`` messages
  with ``tool_call_id``. The model's calls are parsed from its output in its chat template's
  format (see ``asyncllm.tool_calling.tool_calls``; a template without tool support answers 400;
  ``--chat-template hermes``, a built-in ChatML template with Hermes-style tool calling,
  gives it to a model such as the default one, :mod:`asyncllm.chat_templates`):
  ``message.tool_calls`` (``content`` null when the message was only calls) and
  ``finish_reason`` "tool_calls"; streamed, a call's first ``delta.tool_calls`` item has
  ``index``, ``id``, ``type`` and ``function.name`` (sent once the name is generated), and
  later items ``function.arguments`` pieces as they are generated, which join to the
  call's arguments. "required" and a named function constrain decoding with a
  grammar: the message is only tool calls, each naming an allowed function with
  ``arguments`` that match its ``parameters`` schema (``finish_reason`` "length" if
  ``max_tokens`` cuts one short); combined with a ``response_format`` they answer 400.
  ``add_generation_prompt`` and ``chat_template_kwargs`` go to the template;
  ``chat_template_kwargs`` holds template variables only (``enable_thinking``...): an
  ``apply_chat_template`` option (``chat_template``, ``tokenize``, ``return_dict``, ``tools``,
  ``documents``, ``truncation``...) there answers 400 (``chat_template`` is allowed with
  ``--trust-request-chat-template``, as is a top-level ``chat_template``).
  A thinking model's reasoning (``<think>...</think>``) comes apart from the answer, as
  ``message.reasoning_content`` and ``delta.reasoning_content`` (vLLM's names).
- ``POST /v1/responses``: OpenAI's Responses API over the chat path
  (:mod:`asyncllm.server.responses_api`): ``input`` text or items (messages, function calls
  and their outputs), ``instructions``, function ``tools``, ``previous_response_id`` (kept in
  the server's memory, bounded), ``text.format`` as ``response_format``, streamed events as
  OpenAI sends them (``client.responses.create`` and ``client.responses.stream`` work).
- Logprobs name each token by its own bytes (the tokenizer's token-to-bytes mapping): chat
  ``bytes`` are those bytes, and a token that holds part of a UTF-8 character is named
  OpenAI's way, ``"bytes:\\xe6"`` (``bytes`` ``[230]``); the legacy ``text_offset`` is in
  characters, the pieces of one character sharing its offset.
- ``GET /health``: 200 ``{"status": "running"}``; 503 once the engine has failed. Needs no
  API key.
- ``GET /metrics``: Prometheus text format (see Metrics).

Both generation endpoints take ``model`` (must equal the served name, else 404
``model_not_found``; may be left out), ``temperature`` (default 1), ``top_p``, ``n``
(parallel samples sharing the prompt's KV blocks; at most 128 choices per request),
``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``user``
(ignored), ``stream`` and ``stream_options.include_usage``; and, as vLLM does (with the
``openai`` client: ``extra_body``), ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, plus the engine's ``priority`` (lower is served first; within
``--client-priority-range``) and ``cache_salt`` (within the API key's own cache space). Other
fields are ignored. Each maps to the
:class:`~asyncllm.SamplingParams` field of the same name and range.

Responses: ``finish_reason`` is "stop" (EOS, a stop string or token; ``stop_reason`` names
which), "tool_calls" (chat with tools: the model made calls and stopped) or "length".
``usage`` has ``prompt_tokens`` (once per prompt), ``completion_tokens`` (all choices),
``total_tokens`` and ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the
prefix cache).

Streaming (``stream: true``): server-sent events ``data: {chunk}``, ended by
``data: [DONE]``. Chat streams start with one chunk per choice whose delta is
``{"role": "assistant", "content": ""}``; a choice's last chunk carries its
``finish_reason``. ``usage`` is sent, as OpenAI does, only with
``stream_options: {"include_usage": true}``: then in a last chunk with empty ``choices``
(every other chunk has ``"usage": null``). The status and headers are sent when the first
output is ready, so a request that fails validation still gets its status code. If the
engine fails mid-stream, a last event ``data: {"error": {...}}`` is sent (with the 503's
fixed message).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` for any malformed body (not JSON, invalid UTF-8, empty, not an
object, nested more than 512 levels deep in any field), a field of the wrong type or out of range
(``param`` names it), a top-level field the server does not know (OpenAI's message
"Unrecognized request argument supplied: NAME"), an empty or too long prompt, a ``max_tokens`` (or
``max_completion_tokens``) that does not fit in ``max_model_len`` after the prompt (vLLM's
message: "This model's maximum context length is N tokens. However, you requested M tokens
(P in the messages, C in the completion)..."), token ids outside the vocabulary; 401
without a valid API key; 404 for an unknown model or route (405: wrong method); 413 past
``--max-request-bytes``; 415 for a body that is not ``application/json``; 429
``rate_limit_exceeded`` when ``EngineConfig.max_waiting`` requests already wait (a call
whose n x prompts exceeds ``max_waiting`` is never taken: 400, ``param`` "n"); 503
``server_error`` once the engine has failed (``EngineDeadError``) or while it is not
running; 500 ``server_error`` for anything unexpected. A 5xx carries a fixed message
(never the exception's text, a Python repr or a path); the details go to the server log
(logger ``asyncllm.server``).

Client disconnects: a client that goes away (closing a stream, or timing out on a
non-streamed request) aborts its engine requests, and their KV blocks are free before the
next step; ``asyncllm:request_success_total{finished_reason="abort"}`` counts them (once
per request, whatever its ``n``: see Metrics for what each metric counts).
"""

from asyncllm.server.app import OpenAIServer, create_app
from asyncllm.server.cli import (
    add_serve_arguments,
    app_options_from_args,
    engine_config_from_args,
    main,
    serve,
)

__all__ = ["OpenAIServer", "add_serve_arguments", "app_options_from_args", "create_app",
           "engine_config_from_args", "main", "serve"]  # fmt: skip
