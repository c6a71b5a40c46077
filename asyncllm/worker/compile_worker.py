"""The child process that compiles an engine's forward (:mod:`asyncllm.worker.compiled`).

    python -m asyncllm.worker.compile_worker '<ModelSource JSON + "num_threads">' ARTIFACT

It loads the model as the engine did (:func:`asyncllm.models.loader.load_model`, then the
runner's paged attention and packed linears), compiles it with the engine's thread count
(Inductor fixes it in its kernels) and writes the artifact. It runs at the lowest CPU
priority with one compiler thread, so the engine's eager steps keep the cores; it exits 0
once the artifact is written, else 1 with the error on its last stderr line, and at once
when the engine's process ends.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import threading
import time


def _exit_with_parent(parent: int) -> None:
    """End this process once the engine's process is gone (it was not closed, or died): a
    compile nobody waits for should not keep a core busy."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str]) -> int:
    spec, path = json.loads(argv[0]), pathlib.Path(argv[1])
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.nice(19)
    import torch
    import torch._inductor.config as inductor_config

    from asyncllm.attention.backend_registry import register
    from asyncllm.kernels.int4_dequant import kernel
    from asyncllm.layers.cpu_linear import pack_linears
    from asyncllm.layers.sibling_linears import fuse_siblings
    from asyncllm.models.loader import load_model
    from asyncllm.worker import compiled

    torch.set_num_threads(int(spec["num_threads"]))
    inductor_config.compile_threads = 1
    try:
        loaded = load_model(
            spec["model"],
            dtype=getattr(torch, spec["dtype"]),
            device=torch.device("cpu"),
            quantization=spec["quantization"],
            quantization_group_size=int(spec["quantization_group_size"]),
        )
        model = loaded.model
        model.set_attn_implementation(register())  # type: ignore[operator]  # as the runner
        fuse_siblings(model)
        pack_linears(model)
        kernel()
        compiled.build_artifact(model, path, int(spec["num_threads"]))
    except Exception as e:
        print(f"{type(e).__name__}: {' '.join(str(e).split())[:500]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
