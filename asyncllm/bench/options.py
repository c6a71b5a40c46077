"""The benchmark's command line (``python -m asyncllm bench``): its options, as a table, and
what they resolve to (engine columns, asyncllm precision variants, workload lists)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from asyncllm.bench.workloads import ALL

PEERS = ("vllm", "hf", "hf_cb", "llamacpp")
LABELS = {
    "asyncllm": "asyncllm",
    "vllm": "vLLM-CPU",
    "hf": "transformers generate (static)",
    "hf_cb": "transformers CB",
    "llamacpp": "llama.cpp",
}
# W1J's reason for the peers that have no structured outputs here.
NO_GRAMMAR = "no JSON-schema constrained decoding in its API as this harness drives it"
# What each peer cannot run, and why (reported as skipped).
UNSUPPORTED = {
    "hf": {
        "W1J": f"{NO_GRAMMAR} (generate takes no grammar)",
        "W4": "static batching admits no request while a batch runs (no online serving)",
        "W5": "no KV cache budget to shrink (W5 is asyncllm's preemption check)",
    },
    "hf_cb": {
        "W1J": f"{NO_GRAMMAR} (generate_batch takes no grammar)",
        "W4": "offline API (generate_batch's manager); not run online here",
        "W5": "no KV cache budget to shrink (W5 is asyncllm's preemption check)",
    },
    "vllm": {
        "W5": "its KV cache is sized in whole GiB (VLLM_CPU_KVCACHE_SPACE); W5 is asyncllm's "
        "preemption check",
    },
    "llamacpp": {
        "W1J": f"{NO_GRAMMAR} (its GBNF sampler is not wired into the batched argmax loop)",
        "W4": "offline batched decode loop over llama-cpp-python's low-level API (no server)",
        "W5": "no KV cache budget to shrink (W5 is asyncllm's preemption check)",
    },
}
# The dtypes --vllm-dtype accepts (vLLM-CPU's float16 is not benchmarked here).
VLLM_DTYPES = ("float32", "bfloat16")
# asyncllm settings (EngineConfig fields) a variant may set: its precision and speculative
# decoding; and the bare words --asyncllm-variants accepts for them.
VARIANT_KEYS = ("dtype", "quantization", "speculative_tokens")
VARIANT_WORDS = {
    **{d: "dtype" for d in ("float32", "float16", "bfloat16", "auto")},
    **{q: "quantization" for q in ("int8", "int4", "gguf")},
}


def base_engine(engine: str) -> str:
    """The engine a column runs: "asyncllm" for its thread and precision variants
    ("asyncllm-t1", "asyncllm-bfloat16"), "vllm" for "vllm-bfloat16", "llamacpp" for
    "llamacpp-lookup"; else ``engine``."""
    for base in ("asyncllm", "vllm", "llamacpp"):
        if engine.startswith(base):
            return base
    return engine


def vllm_columns(dtypes: Sequence[str]) -> list[tuple[str, str, str]]:
    """``(engine name, report label, dtype)`` of each --vllm-dtype column: the first is
    "vllm" (labelled "vLLM-CPU" in float32), the others "vllm-<dtype>"."""
    out = []
    for i, d in enumerate(dtypes):
        name = "vllm" if i == 0 else f"vllm-{d}"
        out.append((name, LABELS["vllm"] + ("" if d == "float32" else f" ({d})"), d))
    return out


def parse_variants(text: str | None) -> list[dict[str, str]]:
    """``--asyncllm-variants``: variants separated by ";", each a comma list of
    ``key=value`` (keys: dtype, quantization, speculative_tokens) or bare words (a dtype such
    as ``bfloat16``, or a quantization such as ``gguf``). ``quantization=none`` means none.

    Raises:
        SystemExit: an unknown key or word, a key given twice, or an empty variant list.
    """
    out: list[dict[str, str]] = []
    if text is None or text.strip().lower() in ("", "none"):
        return out
    for part in text.split(";"):
        if not part.strip():
            continue
        fields: dict[str, str] = {}
        for item in part.split(","):
            item = item.strip()
            if not item:
                continue
            if "=" in item:
                key, value = (x.strip() for x in item.split("=", 1))
            elif item in VARIANT_WORDS:
                key, value = VARIANT_WORDS[item], item
            else:
                raise SystemExit(
                    f"--asyncllm-variants: unknown {item!r}; use key=value (keys "
                    f"{', '.join(VARIANT_KEYS)}) or one of {', '.join(VARIANT_WORDS)}"
                )
            if key not in VARIANT_KEYS:
                keys = ", ".join(VARIANT_KEYS)
                raise SystemExit(f"--asyncllm-variants: unknown key {key!r}; choose from {keys}")
            if key in fields:
                raise SystemExit(f"--asyncllm-variants: {key} given twice in {part.strip()!r}")
            fields[key] = value
        out.append(fields)
    if not out:
        raise SystemExit(f"--asyncllm-variants {text!r} names no variant")
    return out


def precision_config(
    dtype: str | None, quantization: str | None, speculative_tokens: str | None = None
) -> dict[str, Any]:
    """The EngineConfig fields of a precision setting (and speculative decoding's proposal
    length): only those given (``quantization`` "none" means none), so that a field this
    asyncllm lacks is never passed unasked.

    Raises:
        SystemExit: EngineConfig rejects the values (an unknown dtype or quantization, a
            speculative_tokens that is not an integer >= 0, or a field this version does not
            have), with its message.
    """
    cfg: dict[str, Any] = {}
    if dtype is not None:
        cfg["dtype"] = dtype
    if quantization is not None:  # "none" is passed as None: the default is "auto"
        cfg["quantization"] = None if quantization.lower() == "none" else quantization
    if speculative_tokens is not None:
        try:
            cfg["speculative_tokens"] = int(speculative_tokens)
        except ValueError:
            raise SystemExit(
                f"--asyncllm-variants: speculative_tokens must be an integer, "
                f"got {speculative_tokens!r}"
            ) from None
    from asyncllm import EngineConfig

    try:
        EngineConfig(**cfg)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        shown = ", ".join(f"{k}={v}" for k, v in cfg.items())
        raise SystemExit(f"asyncllm rejects {shown}: {e}") from None
    return cfg


def same_precision(cfg: dict[str, Any], model: str) -> dict[str, Any]:
    """``cfg`` with the engine's CPU dtype made explicit (no dtype, or "auto", means what
    "auto" picks for ``model`` on this CPU), so that equal precisions compare equal."""
    import torch

    from asyncllm.models.loader import stored_dtype
    from asyncllm.worker.device import resolve_dtype

    dtype = cfg.get("dtype") or "auto"
    if dtype == "auto":
        picked = resolve_dtype("auto", torch.device("cpu"), stored_dtype(model))
        dtype = str(picked).removeprefix("torch.")
    return {**cfg, "dtype": dtype}


def variant_name(cfg: dict[str, Any]) -> tuple[str, str]:
    """The engine name (a file name) and report label of an asyncllm variant."""
    words = [
        f"speculative {cfg[k]}" if k == "speculative_tokens" else cfg[k] or "none"
        for k in VARIANT_KEYS
        if k in cfg
    ] or ["default"]
    slug = "-".join("".join(c if c.isalnum() else "_" for c in w) for w in words)
    return f"asyncllm-{slug}", f"asyncllm ({', '.join(words)})"


def parse_list(s: str | None, allowed: Sequence[str]) -> list[str]:
    if s is None:
        return list(allowed)
    if s.strip().lower() in ("", "none"):
        return []
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {', '.join(allowed)}")
    return out


#: ``python -m asyncllm bench``'s options: flag and ``add_argument`` keywords.
OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--quick", {"action": "store_true", "help": "small workloads, 1 run, peer hf only"}),
    ("--repeats", {"type": int, "help": "counted runs per workload (3)"}),
    ("--workloads", {"help": f"comma list of {','.join(ALL)}"}),
    ("--peers", {"help": f"comma list of {','.join(PEERS)}, or none"}),
    ("--threads", {"type": int, "help": "torch threads (engine default)"}),
    ("--compare-threads", {"help": "other thread counts for asyncllm under --compare-workloads "
                           "(default: 1, or 2 where the engine default is 1; 'none' to skip)"}),
    ("--compare-workloads", {"default": "W1,W3,W4"}),
    ("--w4-rate", {"type": float, "default": 1.0, "help": "W4 arrivals per second"}),
    ("--w4-duration", {"type": float, "default": 60.0, "help": "W4 arrival window (s)"}),
    ("--w4-repeats", {"type": int, "help": "W4 counted runs (1)"}),
    ("--repeats-all", {"action": "store_true", "help": "--repeats for W4 and W5 too (else 1)"}),
    ("--peer-run-budget", {"type": float, "default": 90.0, "help": "a peer whose counted run "
                           "takes longer than this (s) runs that workload once"}),
    ("--hf-cb-workloads", {"default": "W1,W3,W6", "help": "workloads for transformers CB (slow)"}),
    ("--kv-gib", {"type": int, "default": 1, "help": "KV cache of asyncllm and vLLM (GiB)"}),
    ("--max-model-len", {"type": int, "default": 2048}),
    ("--model", {"default": "default", "help": '"default" or an HF directory'}),
    ("--dtype", {"help": "asyncllm's EngineConfig.dtype (engine default: auto)"}),
    ("--quantization", {"help": "asyncllm's EngineConfig.quantization (none)"}),
    ("--asyncllm-variants", {"help": 'more asyncllm columns, ";"-separated, each a comma list '
                             'of dtype=D, quantization=Q, speculative_tokens=K or bare '
                             'words: e.g. "float32;bfloat16;speculative_tokens=4"'}),
    ("--vllm-venv", {"help": "venv of vllm_cpu_setup.sh"}),
    ("--vllm-dtype", {"default": "float32", "help": "vLLM-CPU's dtype, or a comma list for a "
                      f"column each ({', '.join(VLLM_DTYPES)})"}),
    ("--llamacpp-venv", {"help": "venv of llamacpp_setup.sh"}),
    ("--llamacpp-gguf", {"help": "GGUF file for llama.cpp (default: the default model's own "
                         "Q4_1 file)"}),
    ("--llamacpp-lookup", {"type": int, "default": 0, "help": "a llama.cpp column with its "
                           "prompt-lookup decoding (llama-cpp-python's "
                           "LlamaPromptLookupDecoding), up to K proposed tokens: one stream "
                           "only (W3, W7); 0: none"}),
    ("--llamacpp-extra-bufts", {"action": "store_true", "help": "llama.cpp's extra weight "
                                "buffer types (AMX; off: they die with SIGILL on some VMs)"}),
    ("--vllm-bind", {"default": "auto", "help": "VLLM_CPU_OMP_THREADS_BIND (auto: 1 core kept)"}),
    ("--parallel-start", {"action": "store_true", "help": "load all engines at once"}),
    ("--prompts", {"help": "prompts.json (default: the packaged copy)"}),
    ("--out", {"default": "bench-results", "help": "output folder"}),
    ("--img-dir", {"help": "plots folder (default OUT/img)"}),
    ("--no-plots", {"action": "store_true"}),
    ("--no-cold-start", {"action": "store_true"}),
    ("--ceiling-mib", {"type": int, "default": 256, "help": argparse.SUPPRESS}),
    ("--fidelity", {"action": "store_true", "help": "run the fidelity harness instead of the "
                    "workloads: every precision path against the float32 reference "
                    "(asyncllm.bench.fidelity)"}),
    ("--fidelity-paths", {"help": "comma list of the fidelity paths to run (default: all)"}),
    ("--fidelity-text", {"help": "text for the fidelity perplexity (default: "
                         "tests/data/public_domain.txt)"}),
)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m asyncllm bench`` (:data:`OPTIONS`)."""
    ap = argparse.ArgumentParser(
        prog="python -m asyncllm bench",
        description="W1-W6 of ../shared/bench/WORKLOADS.md against asyncllm and its peers.",
    )
    for flag, kw in OPTIONS:
        ap.add_argument(flag, **kw)
    return ap


def resolve(args: argparse.Namespace, default_threads: int) -> list[str]:
    """Fill in the defaults that depend on other options (in place) and check the values;
    returns the workload names to run.

    Raises:
        SystemExit: an unknown name in a list, an empty list, a count below 1, or a
            precision EngineConfig rejects.
    """
    args.threads = default_threads if args.threads is None else args.threads
    if args.compare_threads is None:
        args.compare_threads = [] if args.quick else [1 if args.threads > 1 else 2]
    else:
        allowed = [str(i) for i in range(1, 257)]
        args.compare_threads = [int(x) for x in parse_list(args.compare_threads, allowed)]
    args.compare_threads = [t for t in args.compare_threads if t != args.threads]
    args.compare_workloads = parse_list(args.compare_workloads, ALL)
    args.hf_cb_workloads = parse_list(args.hf_cb_workloads, ALL)
    if args.quick:
        args.repeats = 1 if args.repeats is None else args.repeats
        args.peers = args.peers if args.peers is not None else "hf"
    args.repeats = 3 if args.repeats is None else args.repeats
    args.peers = parse_list(args.peers, PEERS)
    names = parse_list(args.workloads, ALL)
    try:
        args.vllm_dtype = list(dict.fromkeys(parse_list(args.vllm_dtype, VLLM_DTYPES)))
    except SystemExit as e:
        raise SystemExit(f"--vllm-dtype: {e}") from None
    if not args.vllm_dtype:
        raise SystemExit(f"--vllm-dtype names no dtype; choose from {', '.join(VLLM_DTYPES)}")
    # A variant sets the fields it names and keeps --dtype / --quantization for the others;
    # one equal to the main column's precision, or to an earlier variant, is dropped.
    args.precision = precision_config(args.dtype, args.quantization)
    args.variants = []
    seen = [same_precision(args.precision, args.model)]
    for v in parse_variants(args.asyncllm_variants):
        cfg = precision_config(
            v.get("dtype", args.dtype),
            v.get("quantization", args.quantization),
            v.get("speculative_tokens"),
        )
        if same_precision(cfg, args.model) not in seen:
            seen.append(same_precision(cfg, args.model))
            args.variants.append(cfg)
    if not names:
        raise SystemExit("--workloads names no workload")
    for flag, value in (("--threads", args.threads), ("--repeats", args.repeats)):
        if value < 1:
            raise SystemExit(f"{flag} must be at least 1, got {value}")
    if args.llamacpp_lookup < 0:
        raise SystemExit(f"--llamacpp-lookup must be at least 0, got {args.llamacpp_lookup}")
    return names
