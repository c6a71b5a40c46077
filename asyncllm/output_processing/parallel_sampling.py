"""Parallel sampling (``SamplingParams.n > 1``), the front end's side.

One call with ``n`` samples becomes ``n`` core requests: ids ``request_id + SAMPLE_ID_SEP +
str(i)``, params from :meth:`SamplingParams.sample_params` (``n=1`` and a derived seed),
one prompt and arrival time, and ``group_id`` = the call's id so that the scheduler shares
running slots fairly between calls. The core's side (a hidden prefix request whose KV
blocks the samples fork, fair shares) is :mod:`asyncllm.core.parallel`. Each sample streams
its own items tagged with its ``index``; :func:`merge_samples` folds the whole outputs of a
call into one (vLLM's ``RequestOutput.outputs`` as ``samples``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from asyncllm.core.request import SAMPLE_ID_SEP, Request
from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

__all__ = ["check_num_samples", "make_samples", "merge_samples", "num_samples", "shares_prompt"]

#: ``make(request_id, prompt, params)``: one validated core request (priority and cache
#: salt already bound), as ``InputProcessor.make_request``.
MakeRequest = Callable[[str, Any, SamplingParams], Request]


def num_samples(params: object) -> int:
    """The core requests a call with ``params`` makes (its ``n``; 1 for bad params, which
    are refused later with their own error)."""
    n = getattr(params, "n", 1) if isinstance(params, SamplingParams) else 1
    return n if isinstance(n, int) and n >= 1 else 1


def check_num_samples(params: SamplingParams, max_num_seqs: int) -> None:
    """Refuse more samples than can ever run at once.

    Raises:
        InvalidRequestError: ``params.n`` above ``max_num_seqs`` (``EngineConfig``).
    """
    if params.n > max_num_seqs:
        raise InvalidRequestError(
            f"n={params.n} parallel samples exceed max_num_seqs="
            f"{max_num_seqs} (the most requests running at once)"
        )


def make_samples(
    make: MakeRequest, request_id: str, prompt: Any, params: SamplingParams
) -> list[Request]:
    """The ``params.n`` core requests of one call (see the module docstring); the prompt
    is tokenized once, by the first sample.

    Raises:
        InvalidRequestError: whatever ``make`` raises for the call.
    """
    first = make(f"{request_id}{SAMPLE_ID_SEP}0", prompt, params.sample_params(0))
    samples = [first]
    for i in range(1, params.n):
        r = make(f"{request_id}{SAMPLE_ID_SEP}{i}", first.prompt_token_ids, params.sample_params(i))
        r.arrival_time = first.arrival_time
        samples.append(r)
    for r in samples:  # one call: the scheduler shares slots fairly between calls
        r.group_id = request_id
    return samples


def shares_prompt(samples: Sequence[Request]) -> bool:
    """Whether the samples of one call compute their prompt once and share its KV blocks;
    not when they score the prompt (``prompt_logprobs``): each then computes it, as
    separate requests."""
    return len(samples) > 1 and samples[0].params.prompt_logprobs is None


def merge_samples(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One output for a call from the whole output of each sample (index order): the only
    one, or sample 0's with all of them in ``samples``."""
    if len(outputs) == 1:
        return outputs[0]
    return msgspec.structs.replace(outputs[0], samples=list(outputs))
