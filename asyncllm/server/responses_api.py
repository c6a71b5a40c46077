"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

A Responses body becomes a chat call (:func:`responses_call`): ``instructions`` a system
message, ``input`` (a string, or a list of message, ``function_call`` and
``function_call_output`` items) the messages, function ``tools`` in their chat form,
``max_output_tokens`` the token limit, ``text.format`` the ``response_format``;
``previous_response_id`` puts the earlier response's conversation (its input and output,
not its instructions, as OpenAI documents) in front. Responses are kept for that in a
bounded store in the server's memory (:class:`ResponseStore`, least recently used out;
``store: false`` keeps none); a restarted server forgets them.

The answer (:class:`ResponsesShape`) is a ``response`` object whose ``output`` holds a
``reasoning`` item (a thinking model's text), a ``message`` with ``output_text``, and one
``function_call`` item per tool call. Streamed, it is OpenAI's event sequence:
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``,
its deltas (``response.reasoning_text.delta``, ``response.output_text.delta`` inside a
``content_part``, ``response.function_call_arguments.delta``), their ``.done`` events and
``response.output_item.done``, and last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it), each with a ``sequence_number``.

Not served: built-in tools (web search, file search...), ``background``, ``conversation``
objects, audio and image inputs: each is refused with a 400 naming the field.
"""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any

import msgspec

from asyncllm.outputs import RequestOutput
from asyncllm.server import protocol as p
from asyncllm.server.drivers import Choice, total_usage
from asyncllm.server.endpoints import EngineCall, chat_call

__all__ = ["ResponseStore", "ResponsesRequest", "ResponsesShape", "responses_call"]


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A ``/v1/responses`` body (OpenAI's fields this server serves; vLLM's extensions
    ``priority`` and ``cache_salt``)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    priority: int | None = None
    cache_salt: str | None = None


class ResponseStore:
    """Finished responses' conversations by response id, for ``previous_response_id``:
    at most ``capacity``, the least recently used dropped first."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation (chat messages) of a stored response.

        Raises:
            APIError: 404 (``param`` "previous_response_id") for an unknown id.
        """
        messages = self._items.get(response_id)
        if messages is None:
            raise p.APIError(
                f"Previous response with id '{response_id}' not found.",
                404,
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self._items.move_to_end(response_id)
        return messages

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        """Keep a conversation, dropping the least recently used past ``capacity``."""
        self._items[response_id] = messages
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or the text of its ``input_text``/``output_text``
    parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise p.APIError(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise p.APIError(
                f"{where}.content[{j}]: only input_text and output_text parts are served",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from a Responses ``input``; consecutive ``function_call`` items become
    one assistant message's ``tool_calls``.

    Raises:
        APIError: 400 (``param`` "input") for an item of a kind not served or malformed.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise p.APIError(
                    f"{where}.role must be user, assistant, system or developer", param="input"
                )
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise p.APIError(f"{where}.output must be a string", param="input")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise p.APIError(f"{where}: items of type {kind!r} are not served", param="input")
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise p.APIError(
                f"tools[{i}]: only function tools are served, not {kind!r}", param="tools"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise p.APIError("text.format must be an object with a type", param="text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}  # json_object, or refused by response_format's check


def responses_call(
    req: ResponsesRequest,
    store: ResponseStore,
    priorities: tuple[int, int],
    reserved_template_options: frozenset[str],
    server_template: str | None = None,
) -> tuple[EngineCall, list[dict[str, Any]]]:
    """The chat call of a Responses body, and the conversation it continues (its messages
    without ``instructions``: what :class:`ResponseStore` keeps once it is answered).

    Raises:
        APIError: 400 naming the field (a tool that is not a function, an input item not
            served, ``truncation`` "auto", a field out of range...), 404 for an unknown
            ``previous_response_id``.
    """
    if req.truncation not in (None, "disabled"):
        raise p.APIError("only truncation 'disabled' is served", param="truncation")
    history = store.get(req.previous_response_id) if req.previous_response_id else []
    conversation = [*history, *input_messages(req.input)]
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    try:
        chat = p.ChatCompletionRequest(
            messages=[*messages, *conversation],
            model=req.model,
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stream=req.stream,
            user=req.user,
            tools=_chat_tools(req.tools),
            tool_choice=_chat_tool_choice(req.tool_choice),
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=_response_format(req.text),
            priority=req.priority,
            cache_salt=req.cache_salt,
        )
        call = chat_call(
            chat,
            priorities,
            reserved_template_options,
            trust_template=False,
            server_template=server_template,
        )
    except p.APIError as e:
        names = {"max_completion_tokens": "max_output_tokens", "response_format": "text"}
        e.param = names.get(e.param or "", e.param)
        raise
    return call, conversation


class ResponsesShape:
    """``/v1/responses`` bodies and events for one call (one choice), and its conversation
    kept in ``store`` once it is done (unless ``keep`` is False).

    Args:
        req: the request (echoed in the ``response`` object).
        model: the served name.
        conversation: the call's messages without instructions.
        store: where a finished response is kept; keep: keep it.
    """

    def __init__(
        self,
        req: ResponsesRequest,
        model: str,
        conversation: list[dict[str, Any]],
        store: ResponseStore,
        *,
        keep: bool = True,
    ) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.req = req
        self.model = model
        self.conversation = conversation
        self.store = store
        self.keep = keep
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # the output items, as they are now
        self._open: dict[str, int] = {}  # open items: "reasoning", "message" or a call id
        self._calls: list[int] = []  # each call's output index, in the parser's call order

    # ----------------------------------------------------------------- the response

    def _response(self, status: str, choice: Choice | None) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": self._items,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": self.keep,
            "usage": None,
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if choice is not None:
            u = total_usage([choice])
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            body["usage"] = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": u.completion_tokens,
                # the thinking's tokens are not counted apart (its text is split, not its ids)
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            }
        return body

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _at(self, kind: str, index: int, **fields: Any) -> dict[str, Any]:
        """An event of output item ``index`` (its id and index)."""
        return self._event(kind, item_id=self._items[index]["id"], output_index=index, **fields)

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        """The non-streamed ``response`` object."""
        (choice,) = choices
        assert choice.last is not None
        if choice.reasoning:
            self._open_item("reasoning", name="")
            self._items[-1]["content"][0]["text"] = "".join(choice.reasoning)
        text = "".join(choice.text)
        if text or not choice.tool_calls:
            self._open_item("message", name="")
            self._items[-1]["content"][0]["text"] = text
        for call in choice.tool_calls:
            self._open_item(call.id, name=call.name)
            self._items[-1]["arguments"] = call.arguments
        response: dict[str, Any] = self._finish(choice)[-1]["response"]
        return response

    def preamble(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [
            self._event("response.created", response=self._response("in_progress", None)),
            self._event("response.in_progress", response=self._response("in_progress", None)),
        ]

    def chunk(self, choice: Choice, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
        """The events of one output: items opened, their deltas, and at the end every item
        closed and the final ``response``."""
        events: list[dict[str, Any]] = []
        if out.reasoning:
            events += self._open_item("reasoning", name="")
            index = self._open["reasoning"]
            self._items[index]["content"][0]["text"] += out.reasoning
            events.append(
                self._at(
                    "response.reasoning_text.delta", index, content_index=0, delta=out.reasoning
                )
            )
        if out.text:
            events += self._open_item("message", name="")
            index = self._open["message"]
            self._items[index]["content"][0]["text"] += out.text
            events.append(
                self._at(
                    "response.output_text.delta",
                    index,
                    content_index=0,
                    delta=out.text,
                    logprobs=[],
                )
            )
        for d in out.tool_call_deltas or ():
            if d.id is not None:
                events += self._open_item(d.id, name=d.name or "")
            index = self._calls[d.index]
            if d.arguments:
                self._items[index]["arguments"] += d.arguments
                events.append(
                    self._at("response.function_call_arguments.delta", index, delta=d.arguments)
                )
        if out.finished:
            if not self._items:  # an empty answer is still one message
                events += self._open_item("message", name="")
            events += self._finish(choice)
        return events

    def usage_chunk(self, usage: Any) -> None:
        """None: the usage is in ``response.completed``."""
        return None

    # ----------------------------------------------------------------- items

    def _open_item(self, key: str, *, name: str) -> list[dict[str, Any]]:
        """Open the output item ``key`` ("reasoning", "message" or a call id, ``name`` its
        function) unless it is open; open items are closed first (OpenAI's items come one
        at a time)."""
        if key in self._open:
            return []
        events = self._close_all()
        uid = uuid.uuid4().hex[:24]
        if key == "reasoning":
            item: dict[str, Any] = {
                "type": "reasoning",
                "id": f"rs_{uid}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
            }
        elif key == "message":
            item = {
                "type": "message",
                "id": f"msg_{uid}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            item = {
                "type": "function_call",
                "id": f"fc_{uid}",
                "call_id": key,
                "name": name,
                "arguments": "",
                "status": "in_progress",
            }
            self._calls.append(len(self._items))
        index = len(self._items)
        self._items.append(item)
        self._open[key] = index
        events.append(
            self._event("response.output_item.added", output_index=index, item=dict(item))
        )
        if key == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(
                self._at("response.content_part.added", index, content_index=0, part=dict(part))
            )
        return events

    def _close_all(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index in self._open.values():
            item = self._items[index]
            kind = item["type"]
            if kind == "reasoning":
                text = item["content"][0]["text"]
                events.append(
                    self._at("response.reasoning_text.done", index, content_index=0, text=text)
                )
            elif kind == "message":
                part = item["content"][0]
                events.append(
                    self._at(
                        "response.output_text.done",
                        index,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    )
                )
                events.append(
                    self._at("response.content_part.done", index, content_index=0, part=dict(part))
                )
            else:
                events.append(
                    self._at(
                        "response.function_call_arguments.done",
                        index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            if "status" in item:
                item["status"] = "completed"
            events.append(
                self._event("response.output_item.done", output_index=index, item=dict(item))
            )
        self._open.clear()
        return events

    def _finish(self, choice: Choice) -> list[dict[str, Any]]:
        assert choice.last is not None
        events = self._close_all()
        status = "incomplete" if choice.last.finish_reason == "length" else "completed"
        response = self._response(status, choice)
        if self.keep:
            self.store.put(self.id, [*self.conversation, self._as_message(choice)])
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events

    @staticmethod
    def _as_message(choice: Choice) -> dict[str, Any]:
        """The answer as the chat message a next turn's template renders."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text)}
        if choice.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in choice.tool_calls
            ]
        return message
