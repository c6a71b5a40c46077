"""What a caller receives."""

from __future__ import annotations

import msgspec


class RequestOutput(msgspec.Struct, kw_only=True):
    """One item of a stream, or the whole result of ``generate()``.

    In a stream, ``token_ids`` and ``text`` hold what is new since the previous item (deltas;
    a slow reader gets several steps merged into one item). From ``generate()`` they hold the
    whole generated sequence.

    Attributes:
        request_id: the request's id.
        token_ids: generated token ids.
        text: their text (never ends inside a multi-byte character).
        finish_reason: None while running, then "stop" (EOS or a stop token), "length"
            (max_tokens or max_model_len reached) or "abort".
        num_prompt_tokens: tokens in the prompt.
        num_generated_tokens: tokens generated so far in total.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True on the last item of a request."""
        return self.finish_reason is not None
