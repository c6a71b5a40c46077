"""The fidelity harness (``python -m asyncllm bench --fidelity``): what it measures and how
(:mod:`~asyncllm.bench.fidelity.measures`), the reference model's figures
(:mod:`~asyncllm.bench.fidelity.reference`), the engine processes
(:mod:`~asyncllm.bench.fidelity.workers`), the run (:mod:`~asyncllm.bench.fidelity.run`) and
its report (:mod:`~asyncllm.bench.fidelity.report`); the questions in ``questions.json``."""
