"""A request's output, from a step's tokens to the caller's items: the step's result as plain
data (:mod:`~asyncllm.output_processing.step_output`), incremental detokenization and stop
strings, each request's :class:`~asyncllm.output_processing.output_processor.RequestState`
(merged for a slow reader), the fan-out and merge of parallel samples, and the wake-up flag a
state raises for its stream (:mod:`~asyncllm.output_processing.wakeup`).

Runs on the event loop; no torch.
"""
