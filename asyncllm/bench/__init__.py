"""The benchmark harness: ``python -m asyncllm bench`` (see :mod:`asyncllm.bench.runner`).

Modules: :mod:`~asyncllm.bench.workloads` (W1-W6 as request lists), :mod:`~asyncllm.bench.worker`
(one engine per process: asyncllm, transformers, vLLM), :mod:`~asyncllm.bench.ceilings` (the
machine's copy bandwidth and matmul FLOP/s), :mod:`~asyncllm.bench.runner` (the run),
:mod:`~asyncllm.bench.report` (tables and plots).
"""
