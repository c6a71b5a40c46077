"""A benchmark run's results: its records as ``summary.json``
(:mod:`~asyncllm.bench.reporting.summary`), as ``report.md``
(:mod:`~asyncllm.bench.reporting.markdown`) and as plots
(:mod:`~asyncllm.bench.reporting.plots`)."""
