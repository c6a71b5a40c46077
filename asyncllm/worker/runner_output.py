"""What the model runner hands back for one step, as plain Python (no torch).

These types cross from the worker to the engine core and on to the async front end, which
must not import torch (``tests/project/test_import_graph.py``), so they live apart from
:mod:`asyncllm.worker.sampling.sampler`, which computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

#: One position's logprobs as plain Python: (logprob of the chosen token, its rank (1 = the
#: most likely), the top token ids, their logprobs), logprobs in nats.
TokenLogprobs = tuple[float, int, list[int], list[float]]


@dataclass
class RunnerOutput:
    """What one step of the model runner produced, as plain Python.

    Attributes:
        sampled: request id -> sampled token id, for each chunk with ``sample`` set.
        logprobs: request id -> the sampled token's :data:`TokenLogprobs`, for sampled
            requests that ask for logprobs.
        prompt_logprobs: request id -> (index in the prompt of the first token scored, one
            :data:`TokenLogprobs` per prompt token scored this step).
        spec_tokens: request id -> the tokens a speculative chunk yields (its first is also
            in ``sampled``; :mod:`asyncllm.worker.sampling.speculative`), or None.
        spec_logprobs: request id -> one :data:`TokenLogprobs` per token of ``spec_tokens``,
            for speculative requests that ask for logprobs, or None.
    """

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs] | None = None
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
    spec_tokens: dict[str, list[int]] | None = None
    spec_logprobs: dict[str, list[TokenLogprobs]] | None = None
