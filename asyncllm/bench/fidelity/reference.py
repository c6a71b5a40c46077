"""The fidelity harness's reference (:mod:`asyncllm.bench.fidelity`): transformers' own model
in float32 with eager attention, computed once per model and input and cached.

The weights are the model directory's as they are: for a GGUF file, the directory asyncllm's
loader converted it to (:func:`asyncllm.models.loader.resolve_model_dir`), which is
transformers' ``from_pretrained(..., gguf_file=..., dequantize=True)`` saved as float32
safetensors: gguf-py's own dequantization of every tensor, checked by the loader against the
GGUF model's logits. No asyncllm layer, kernel or quantization is involved.

Cache: ``fidelity_reference.json`` in the output folder holds, under a key of the model's
files and the torch and transformers versions, one entry per window and per question (keyed
by a hash of its token ids), so a ``--quick`` run reuses a full run's entries and a later run
computes only what is new.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

CACHE_NAME = "fidelity_reference.json"


def model_key(model_dir: pathlib.Path) -> str:
    """A key of the model's config and weight files (names, sizes, mtimes) and the torch and
    transformers versions: another model, a re-conversion or an upgrade changes it."""
    import torch
    import transformers

    parts = [(model_dir / "config.json").read_text(), torch.__version__, transformers.__version__]
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def ids_key(ids: Sequence[int], *extra: object) -> str:
    """A short hash of token ids (and ``extra``), the key of one cached entry."""
    return hashlib.sha256(json.dumps([list(ids), *extra]).encode()).hexdigest()[:16]


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The model's EOS ids: its generation config's and its tokenizer's."""
    out: list[int] = []
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in out:
                out.append(int(v))
    return out


def load_reference_model(model_dir: pathlib.Path, threads: int) -> tuple[Any, Any]:
    """transformers' model of ``model_dir`` in float32 with eager attention, and its
    tokenizer (local files only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


def score_window(model: Any, ids: Sequence[int]) -> dict[str, list[Any]]:
    """Teacher-forced figures of one window, for each token after the first: its log-prob,
    the most likely token there, and the gap between the top two log-probs."""
    import torch

    x = torch.tensor([list(ids)])
    with torch.inference_mode():
        logprobs = model(x).logits[0, :-1].float().log_softmax(-1)
    actual = logprobs.gather(-1, x[0, 1:, None])[:, 0]
    top2 = logprobs.topk(2, dim=-1)
    return {
        "logprobs": actual.tolist(),
        "top": logprobs.argmax(-1).tolist(),  # the first index on a tie, as greedy takes
        "gap": (top2.values[:, 0] - top2.values[:, 1]).tolist(),
    }


def greedy_answer(model: Any, prompt: Sequence[int], n: int) -> dict[str, list[Any]]:
    """``n`` greedy tokens after ``prompt`` (argmax, first index on a tie, EOS not special)
    with transformers' KV cache, and the gap between the top two log-probs at each."""
    import inspect

    import torch

    # transformers 5.24 renamed the KV cache argument and output "cache" (was past_key_values)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids: list[int] = []
    gaps: list[float] = []
    x = torch.tensor([list(prompt)])
    past = None
    with torch.inference_mode():
        for _ in range(n):
            out = model(input_ids=x, use_cache=True, **{name: past})
            past = getattr(out, name)
            top2 = out.logits[0, -1].float().log_softmax(-1).topk(2)
            tok = int(out.logits[0, -1].argmax())
            ids.append(tok)
            gaps.append(float(top2.values[0] - top2.values[1]))
            x = torch.tensor([[tok]])
    return {"ids": ids, "gaps": gaps}


def load_cache(path: pathlib.Path, key: str) -> dict[str, Any]:
    """The cache file's entries when it was made for ``key``; else an empty cache."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("key") != key:
        return {"key": key, "windows": {}, "answers": {}}
    return data


def compute(
    model_dir: pathlib.Path,
    windows: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    n: int,
    cache: pathlib.Path,
    threads: int,
    model: Any = None,
) -> dict[str, Any]:
    """The reference's figures of ``windows`` and its ``n``-token greedy answers to
    ``prompts``, from ``cache`` where there, else computed (and the cache updated).

    Args:
        model: the reference model when already loaded (:func:`load_reference_model`).

    Returns:
        ``{"windows": [...], "answers": [...], "computed_s": seconds spent computing, "key":
        the model key}``, each window as :func:`score_window` returns it, each answer as
        :func:`greedy_answer`.
    """
    key = model_key(model_dir)
    data = load_cache(cache, key)
    t = time.perf_counter()
    wkeys = [ids_key(w) for w in windows]
    akeys = [ids_key(p, n) for p in prompts]
    todo = [k for k in wkeys if k not in data["windows"]] + [
        k for k in akeys if k not in data["answers"]
    ]
    if todo and model is None:
        model, _ = load_reference_model(model_dir, threads)
    for k, w in zip(wkeys, windows, strict=True):
        if k not in data["windows"]:
            data["windows"][k] = score_window(model, w)
    for k, p in zip(akeys, prompts, strict=True):
        if k not in data["answers"]:
            data["answers"][k] = greedy_answer(model, p, n)
    elapsed = time.perf_counter() - t
    if todo:
        cache.write_text(json.dumps(data))
    return {
        "windows": [data["windows"][k] for k in wkeys],
        "answers": [data["answers"][k] for k in akeys],
        "computed_s": elapsed if todo else 0.0,
        "key": key,
    }
