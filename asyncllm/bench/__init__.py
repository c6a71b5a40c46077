"""The benchmark harness: ``python -m asyncllm bench`` (see :mod:`asyncllm.bench.runner`).

Modules: :mod:`~asyncllm.bench.workloads` (W1-W6 as request lists),
:mod:`~asyncllm.bench.engine_process` (one engine per process: the protocol, vLLM and llama.cpp;
asyncllm's in :mod:`~asyncllm.bench.asyncllm_engine`, transformers' in
:mod:`~asyncllm.bench.hf_engines`), :mod:`~asyncllm.bench.ceilings` (the
machine's copy bandwidth and matmul FLOP/s), :mod:`~asyncllm.bench.runner` (the run),
:mod:`~asyncllm.bench.reporting` (a run's ``summary.json``, ``report.md`` and plots); the
fidelity harness (``--fidelity``): :mod:`~asyncllm.bench.fidelity`.
"""
