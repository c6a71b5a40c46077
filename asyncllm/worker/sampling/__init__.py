"""Sampling: a step's logits to one token per sampled row, in vLLM's order
(:mod:`~asyncllm.worker.sampling.sampler`): the rows' settings as tensors
(:mod:`~asyncllm.worker.sampling.batch`), the logits processors (bias, ``min_tokens``,
penalties), the grammar mask, the greedy pick or the draw
(:mod:`~asyncllm.worker.sampling.pick`), the logprobs, and the verification of speculative
chunks (:mod:`~asyncllm.worker.sampling.speculative`)."""
