"""Tool calling for chat calls: how a call's ``tools`` shape its request
(:mod:`~asyncllm.tool_calling.chat_tool_setup`), the call formats and their parsing out of
the model's output, whole or streamed (:mod:`~asyncllm.tool_calling.tool_calls`,
:mod:`~asyncllm.tool_calling.tool_parser`, :mod:`~asyncllm.tool_calling.tool_formats`,
:mod:`~asyncllm.tool_calling.json_stream`), and the reasoning split that comes first, so that
calls are parsed from the answer alone (:mod:`~asyncllm.tool_calling.reasoning`).

Pure Python on the event loop; no torch.
"""
