"""Reasoning text split from the answer, for models that think before they answer in
``<think>...</think>`` (Qwen3, QwQ, DeepSeek-R1 and their distillations).

A chat call's output then carries the thinking in :attr:`RequestOutput.reasoning` and only
the answer in ``text`` (the OpenAI-compatible server sends it as ``reasoning_content``, as
vLLM, SGLang and llama.cpp do); tool calls are parsed from the answer alone.

Which models: those whose chat template handles ``</think>`` (the templates of the
families above strip the thinking from earlier assistant turns, so they name the end marker).
Where the output starts: a template that opens the thinking itself (DeepSeek-R1 and the
"thinking" Qwen3 releases end the generation prompt with ``<think>``) has the output start
inside the reasoning; otherwise the reasoning is an output that begins (after whitespace)
with ``<think>``. With ``chat_template_kwargs={"enable_thinking": False}`` Qwen3's template
closes an empty ``<think></think>`` in the prompt, so the output is all answer. An output
that ends inside the reasoning (``max_tokens`` reached before ``</think>``) has no answer.

Pure Python; no torch.
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncllm.outputs import RequestOutput
from asyncllm.tool_calling.tool_parser import held_prefix

__all__ = ["THINK_END", "THINK_START", "ReasoningParser", "ReasoningSplit", "thinks"]

THINK_START = "<think>"
THINK_END = "</think>"


def thinks(template: str) -> bool:
    """True when the chat template ``template`` (Jinja text) is a thinking model's: it
    handles the end marker ``</think>``."""
    return THINK_END in template


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """True when a rendered prompt ending with ``prompt_tail`` leaves a ``<think>`` open
    (the output starts inside the reasoning)."""
    return prompt_tail.rstrip().endswith(THINK_START)


class ReasoningParser:
    """Splits one generation's text, streamed or whole, into reasoning and answer.

    Feed text deltas with :meth:`feed` and end with :meth:`finish`; each returns
    ``(reasoning, answer)``, the new text of each that can be released (text that could
    still become a marker is held back). Joined, the pieces are the same however the text
    was split; the markers themselves are in neither.

    Args:
        in_reasoning: the output starts inside the reasoning (the prompt opened it).
    """

    def __init__(self, *, in_reasoning: bool) -> None:
        # "start": nothing but whitespace read yet; a <think> may still open the reasoning
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next piece of generated text; returns (reasoning, answer) released."""
        self._buf += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._state, self._buf = "reasoning", head[len(THINK_START) :]
                elif head and not THINK_START.startswith(head):
                    self._state = "answer"
                else:
                    break  # whitespace or a piece of "<think>": wait for more
            elif self._state == "reasoning":
                end = self._buf.find(THINK_END)
                if end < 0:
                    keep = held_prefix(self._buf, THINK_END)
                    reasoning.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                reasoning.append(self._buf[:end])
                # the answer's leading blank lines belong to the format, not the answer
                self._state, self._buf = "after", self._buf[end + len(THINK_END) :]
            elif self._state == "after":
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._state = "answer"
            else:
                answer.append(self._buf)
                self._buf = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The end of the generation: release held-back text (a partial marker is text)."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


class ReasoningSplit:
    """The reasoning side of one ``chat`` call: each output's ``text`` split into
    ``reasoning`` and answer (:meth:`apply`), per parallel sample.

    Args:
        in_reasoning: the prompt opened the thinking (:func:`prompt_opens_thinking`).
        output_kind: the request's ``SamplingParams.output_kind`` ("delta": each item's
            ``reasoning`` and ``text`` are what is new; otherwise everything so far).
    """

    def __init__(self, *, in_reasoning: bool, output_kind: str = "delta") -> None:
        self.in_reasoning = in_reasoning
        self.output_kind = output_kind
        self._parsers: dict[int, ReasoningParser] = {}
        self._seen: dict[int, int] = {}  # cumulative kinds: characters of text read
        self._sofar: dict[int, tuple[str, str]] = {}  # cumulative kinds: (reasoning, answer)

    @classmethod
    def for_prompt(
        cls, tokenizer: Any, template: str, prompt_ids: list[int], output_kind: str
    ) -> ReasoningSplit | None:
        """The split for a prompt rendered by ``template``, or None for a template that
        does not think; reads the prompt's last tokens to see whether it opened the thinking
        (time independent of the prompt's length)."""
        if not thinks(template):
            return None
        tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return cls(in_reasoning=prompt_opens_thinking(tail), output_kind=output_kind)

    def apply(self, out: RequestOutput) -> RequestOutput:
        """``out`` with its text split: ``reasoning`` (None when empty) and the answer in
        ``text``."""
        parser = self._parsers.get(out.index)
        if parser is None:
            parser = self._parsers[out.index] = ReasoningParser(in_reasoning=self.in_reasoning)
        new = out.text
        if self.output_kind != "delta":
            seen = self._seen.get(out.index, 0)
            new, self._seen[out.index] = out.text[seen:], len(out.text)
        reasoning, answer = parser.feed(new)
        if out.finished:
            more_r, more_a = parser.finish()
            reasoning, answer = reasoning + more_r, answer + more_a
        if self.output_kind != "delta":
            old_r, old_a = self._sofar.get(out.index, ("", ""))
            reasoning, answer = old_r + reasoning, old_a + answer
            self._sofar[out.index] = (reasoning, answer)
        return msgspec.structs.replace(out, text=answer, reasoning=reasoning or None)
