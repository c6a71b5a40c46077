"""Input processing: a call's prompt and per-call arguments to validated core requests.

Everything here runs in the front end (the async engine runs the costly parts, tokenizing
and rendering chat templates, on its tokenizer thread) and holds no model state: the
tokenizer and the limits it checks against (``max_model_len``, the vocabulary size, the EOS
tokens, ``max_num_seqs``). Prompt forms: text, token ids, or vLLM's prompt dicts. A prompt
that cannot fit ``max_model_len`` is refused before any work proportional to its size.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
import uuid
from collections.abc import Mapping, Sequence, Sized
from typing import Any, NoReturn

import msgspec

from asyncllm.core.request import Request
from asyncllm.errors import InvalidRequestError
from asyncllm.output_processing.parallel_sampling import check_num_samples, make_samples
from asyncllm.sampling_params import SamplingParams
from asyncllm.tool_calling.tool_calls import check_message_tool_calls, template_messages

__all__ = ["InputProcessor", "PromptType", "max_token_chars"]

logger = logging.getLogger("asyncllm")

#: A prompt: text, token ids, or vLLM's prompt dicts ``{"prompt": str}`` /
#: ``{"prompt_token_ids": [int, ...]}``.
PromptType = str | Sequence[int] | Mapping[str, Any]


class InputProcessor:
    """Validates and tokenizes calls into core requests; changes no engine state.

    Args:
        tokenizer: the model's tokenizer (transformers).
        max_model_len: the most tokens of one sequence, prompt and output.
        vocab_size: the model's vocabulary size (rows of its output embedding).
        eos_token_ids: tokens that end a request unless ``ignore_eos``.
        max_num_seqs: the most requests running at once (bounds ``n``).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_num_seqs: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        #: Characters of a text prompt above which it cannot fit ``max_model_len`` tokens.
        self.max_prompt_chars = max_model_len * max_token_chars(tokenizer)

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = False,
    ) -> Request:
        """Validate and tokenize a call into a core request (no engine state is changed).

        Args:
            prompt: text (tokenized with the model's tokenizer, special tokens added as
                transformers does by default, but no second BOS before a text that starts
                with the BOS token, such as a rendered chat template), token ids (ints, or
                anything with ``__index__``: numpy or torch integers), or vLLM's prompt dicts
                ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``.
            params: the request's sampling parameters; a validated copy is kept, so
                changing the caller's object later does not affect the request.
            cache_salt: isolates this request's prefix-cache sharing (see ``Request``).
            strict_max_tokens: refuse a ``params.max_tokens`` that does not fit in
                ``max_model_len`` after the prompt (by default it is cut to what fits).

        Raises:
            InvalidRequestError: an empty prompt (no ids, or a text that tokenizes to none)
                or one of the wrong type, token ids out of the
                vocabulary (prompt, ``stop_token_ids`` or ``logit_bias``), a prompt of
                ``max_model_len`` tokens or more (a text longer than ``max_prompt_chars``
                is refused before it is tokenized), with ``strict_max_tokens`` a
                ``max_tokens`` above what the prompt leaves (the message names the context
                length, as vLLM's server does), or params that are not valid SamplingParams.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params)}")
        # A validated snapshot: a caller may have set a field to anything since construction.
        params = msgspec.structs.replace(params)
        self._refuse_oversized(prompt)
        token_ids = self._prompt_token_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            self._refuse_tokens(len(token_ids))
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): "
                    f"{bad[:5]}"
                )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str or None, got {cache_salt!r}")
        if params.prompt_logprobs is not None:
            # Every prompt position must be computed to be scored, so the request must not
            # hit the prefix cache: a salt of its own shares no block (as vLLM skips the
            # cache for such requests).
            cache_salt = f"{cache_salt}\x00prompt_logprobs\x00{uuid.uuid4().hex}"
        stop_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        room = self.max_model_len - len(token_ids)
        if strict_max_tokens and params.max_tokens is not None and params.max_tokens > room:
            raise _past_the_context(self.max_model_len, len(token_ids), params.max_tokens)
        return Request(
            request_id,
            token_ids,
            max_tokens=min(params.max_tokens or room, room),
            stop_token_ids=stop_ids,
            min_tokens=params.min_tokens,
            max_model_len=self.max_model_len,
            arrival_time=time.monotonic(),
            priority=priority,
            params=params,
            cache_salt=cache_salt,
        )

    @staticmethod
    def prompt_text(prompt: object) -> str | None:
        """The text of a text prompt (a str or ``{"prompt": str}``), else None."""
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt")
        return prompt if isinstance(prompt, str) else None

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text of ``num_chars`` characters that cannot fit ``max_model_len``
        tokens, before spending time proportional to it on tokenizing it.

        Raises:
            InvalidRequestError: ``num_chars`` above ``max_prompt_chars`` (``max_model_len``
                times the longest token's characters, :func:`max_token_chars`).
        """
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"prompt has {num_chars} characters; it cannot fit max_model_len="
                f"{self.max_model_len} tokens (at most {self.max_prompt_chars} characters "
                "with this tokenizer)"
            )

    def _refuse_oversized(self, prompt: object) -> None:
        """Refuse a prompt that cannot fit before any work proportional to its size: a
        text by its characters, token ids by their count (one more than ``max_model_len``
        at least, so that no BOS handling can bring it under)."""
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
        elif (
            isinstance(prompt, Sized)
            and not isinstance(prompt, (bytes, bytearray))  # refused as a type, later
            and len(prompt) > self.max_model_len
        ):
            self._refuse_tokens(len(prompt))

    def _refuse_tokens(self, num_tokens: int) -> NoReturn:
        raise InvalidRequestError(
            f"prompt has {num_tokens} tokens; max_model_len is {self.max_model_len} "
            "and at least one token must be generated"
        )

    def _prompt_token_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, Mapping):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1:
                raise InvalidRequestError(
                    "a prompt dict must have exactly one of 'prompt' and 'prompt_token_ids'"
                )
            prompt = prompt[keys.pop()]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            try:
                ids = _without_added_bos(self.tokenizer, prompt)
            except (TypeError, ValueError) as e:  # e.g. a lone surrogate
                raise InvalidRequestError(f"prompt cannot be tokenized: {e}") from e
            if not ids:  # a tokenizer may drop all of it (a normalizer, an empty vocab)
                raise InvalidRequestError("prompt is empty: its text tokenizes to no tokens")
            return ids
        if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
            raise InvalidRequestError(
                f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}"
            )
        try:
            token_ids = [operator.index(t) if not isinstance(t, bool) else -1 for t in prompt]
        except TypeError:
            raise InvalidRequestError("prompt token ids must be integers") from None
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        return token_ids

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template (transformers'
        ``apply_chat_template``): :meth:`check_chat`, then :meth:`render_chat`.

        Args:
            messages: OpenAI-style ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the template's assistant header.
            chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking":
                False}``) and ``apply_chat_template`` options (``tools``, ``documents``).

        Raises:
            InvalidRequestError: as :meth:`check_chat` and :meth:`render_chat`.
        """
        self.check_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    def check_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """The cheap checks of a chat call (time linear in the number of messages).

        Raises:
            InvalidRequestError: messages that are not a non-empty list of dicts with a
                str ``role`` and a str, list or None ``content``; malformed assistant
                ``tool_calls`` (``tool_calls.check_message_tool_calls``); contents of more than
                ``max_prompt_chars`` characters in all (text parts of list contents
                counted), which cannot fit ``max_model_len``; bad option types; a tokenizer
                without a chat template.
        """
        if (
            isinstance(messages, (str, bytes, Mapping))
            or not isinstance(messages, Sequence)
            or not messages
        ):
            raise InvalidRequestError("messages must be a non-empty list of dicts")
        num_chars = 0
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"each message must be a dict with a str 'role': {m!r}")
            check_message_tool_calls(i, m)
            content = m.get("content")
            if isinstance(content, str):
                num_chars += len(content)
            elif isinstance(content, list):
                num_chars += sum(
                    len(part["text"])
                    for part in content
                    if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                )
            elif content is not None:
                raise InvalidRequestError(f"message content must be a str or a list: {m!r}")
        # The rendered prompt holds every content, so it is at least this long.
        self.check_prompt_chars(num_chars)
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequestError("add_generation_prompt must be a bool")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise InvalidRequestError("chat_template_kwargs must be a dict or None")
        given = (chat_template_kwargs or {}).get("chat_template")
        if not getattr(self.tokenizer, "chat_template", None) and not given:
            raise InvalidRequestError("the model's tokenizer has no chat template")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Apply the chat template to messages that passed :meth:`check_chat` and tokenize
        (time proportional to the messages: the async front end runs it off its loop).
        Assistant ``tool_calls`` arguments given as JSON strings reach the template decoded
        (``tool_calls.template_messages``).

        The template is rendered to text first and the text's length checked
        (:meth:`check_prompt_chars`) before it is tokenized: a template also renders fields
        that :meth:`check_chat` does not count (roles, names, template variables), and
        tokenizing costs far more than rendering, holding the front end's one tokenizer
        thread meanwhile (docs/tuning.md, "Costs behind smaller code choices"). Then
        transformers' own ``apply_chat_template(tokenize=True)`` tokenizes, so the ids are
        exactly its ids.

        Raises:
            InvalidRequestError: a template that fails on the messages (the template's
                message is included); a rendered prompt too long to fit ``max_model_len``,
                or one of no tokens.
        """
        convs = template_messages(messages)
        kwargs = dict(chat_template_kwargs or {})
        try:
            text = self.tokenizer.apply_chat_template(
                convs, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as e:  # jinja errors, template-raised exceptions, bad kwargs
            raise InvalidRequestError(f"the chat template failed on these messages: {e}") from e
        if isinstance(text, str):
            self.check_prompt_chars(len(text))
        try:
            ids = self.tokenizer.apply_chat_template(
                convs,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        except Exception as e:
            raise InvalidRequestError(f"the chat template failed on these messages: {e}") from e
        ids = list(ids)
        if not ids:
            raise InvalidRequestError("prompt is empty: the chat template rendered no tokens")
        return ids

    def make_requests(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = False,
    ) -> list[Request]:
        """The core requests of one call: one, or one per parallel sample when
        ``params.n > 1`` (:func:`~asyncllm.output_processing.parallel_sampling.make_samples`).
        Validates as :meth:`make_request` does.

        Raises:
            InvalidRequestError: as :meth:`make_request`; ``params.n`` above
                ``max_num_seqs`` (the samples could never all run).
        """
        if isinstance(params, SamplingParams):
            params = msgspec.structs.replace(params)  # re-validates, n included
            check_num_samples(params, self.max_num_seqs)
        make = functools.partial(
            self.make_request,
            priority=priority,
            cache_salt=cache_salt,
            strict_max_tokens=strict_max_tokens,
        )
        if not isinstance(params, SamplingParams) or params.n == 1:
            return [make(request_id, prompt, params)]
        return make_samples(make, request_id, prompt, params)


def _past_the_context(max_model_len: int, num_prompt: int, max_tokens: int) -> InvalidRequestError:
    """The error of a ``max_tokens`` that does not fit after the prompt: vLLM's server's
    message, itself OpenAI's."""
    return InvalidRequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
        f"{max_tokens} in the completion). Please reduce the length of the messages or "
        "completion."
    )


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of ``tokenizer`` can cover: the longest token
    string of its vocabulary, added tokens included.

    A token's string is never shorter than the text it stands for: byte-level BPE (GPT-2,
    Llama 3, SmolLM2) spells each byte as one character and a character is at least one
    byte; SentencePiece spells a space as one "▁" and a byte fallback as "<0x0A>". (A
    tokenizer whose normalizer deletes characters could break this; none of the supported
    families does.) Falls back to 1024 when the vocabulary cannot be listed.
    """
    try:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return max((len(t) for t in tokens if isinstance(t, str)), default=0) or 1024
    except Exception:  # not a transformers tokenizer
        return 1024


def _without_added_bos(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text)`` (special tokens added, as transformers does by default), but
    without a second BOS: a text that already starts with the BOS token's text -- typically a
    chat template rendered with ``tokenize=False``, whose template writes ``{{ bos_token }}``
    -- keeps only its own BOS when the tokenizer would add one too (Llama-2 style
    post-processors). Silently doubled BOS tokens change what the model sees; llama.cpp warns
    about it, and vLLM's chat path tokenizes rendered templates without special tokens. Logged
    (a warning, once per process).
    """
    ids = list(tokenizer.encode(text))
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None or ids[:2] != [bos_id, bos_id] or not text.startswith(bos):
        return ids
    raw = list(tokenizer.encode(text, add_special_tokens=False))
    if raw[:1] != [bos_id] or ids[1 : 1 + len(raw)] != raw:
        return ids  # both BOS are the text's own
    _warn_added_bos(bos)
    return ids[1:]


@functools.cache
def _warn_added_bos(bos: str) -> None:
    logger.warning(
        "the prompt text starts with the BOS token %r and the tokenizer adds one too: the "
        "added BOS is dropped (logged once)",
        bos,
    )
