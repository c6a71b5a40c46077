"""Turns a benchmark run's records into ``summary.json``, ``report.md`` and plots."""

from __future__ import annotations

import contextlib
import pathlib
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from asyncllm.bench import ceilings
from asyncllm.bench.engine_process import percentile
from asyncllm.bench.options import base_engine

ENGINE_ORDER = ("asyncllm", "vllm", "llamacpp", "hf", "hf_cb")


def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _key(workload: str, variant: str | None) -> str:
    return f"{workload}/{variant}" if variant else workload


def _order(engines: Sequence[str]) -> list[str]:
    def rank(e: str) -> tuple[int, str]:
        base = base_engine(e)
        return (ENGINE_ORDER.index(base) if base in ENGINE_ORDER else 9, e)

    return sorted(engines, key=rank)


def build_summary(
    bench: Any, wls: Sequence[Any], cold: dict[str, Any], elapsed_s: float, model_dir: str
) -> dict[str, Any]:
    """Everything the report and the plots need, as plain JSON."""
    args = bench.args
    ceil = ceilings.best_of(bench.ceiling_samples)
    model = {**bench.model_info, "dir": model_dir}

    # Medians over counted runs, per engine and workload (variant).
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in bench.records:
        if r.get("counted"):
            runs.setdefault((r["engine"], _key(r["workload"], r.get("variant"))), []).append(r)
    for (engine, key), rs in runs.items():
        med: dict[str, Any] = {}
        for k, v in rs[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "run":
                med[k] = _median([x.get(k) for x in rs])
            elif k in ("loop_lag_ms", "stats") and isinstance(v, dict):
                med[k] = {
                    kk: _median([x[k].get(kk) for x in rs if isinstance(x.get(k), dict)])
                    for kk, vv in v.items()
                    if isinstance(vv, (int, float))
                }
        med["runs"] = len(rs)
        med["settings"] = rs[0].get("settings")
        med["rss_mb_max"] = max(x.get("rss_mb") or 0 for x in rs)
        figures.setdefault(engine, {})[key] = med

    skips = [
        {
            "engine": r["engine"],
            "workload": _key(r["workload"], r.get("variant")),
            "reason": r["skipped"],
        }
        for r in bench.records
        if "skipped" in r
    ]
    skips += [
        {"engine": e, "label": bench.label(e), "workload": "all", "reason": why}
        for e, why in bench.skipped.items()
    ]

    # Greedy agreement with asyncllm's outputs (first counted run of each); a peer is also
    # compared with each asyncllm precision variant (llama.cpp's Q4_1 with asyncllm's gguf).
    agreement: dict[str, dict[str, float]] = {}
    agreement_detail: list[dict[str, Any]] = []
    variants = [e for e in bench.workers if e.startswith("asyncllm")]
    variants = [e for e in variants if e not in getattr(bench, "thread_engines", [])]
    for (engine, key), outs in bench.outputs.items():
        refs = ["asyncllm"] + ([] if engine.startswith("asyncllm") else variants)
        for r in refs:
            ref = bench.outputs.get((r, key))
            if engine == r or ref is None or len(ref) != len(outs):
                continue
            a = output_agreement(ref, outs)
            if r == "asyncllm":
                agreement.setdefault(key, {})[engine] = a["identical"]
            agreement_detail.append({"workload": key, "engine": engine, "reference": r, **a})
    w5_equal = None
    if ("asyncllm", "W5") in bench.outputs and ("asyncllm", "W1") in bench.outputs:
        w5_equal = bench.outputs[("asyncllm", "W5")] == bench.outputs[("asyncllm", "W1")]

    # W4 distributions (all counted runs' requests).
    w4: dict[str, dict[str, list[float]]] = {}
    for (engine, wl, _variant), rs in bench.raw_runs.items():
        if wl != "W4":
            continue
        for res in rs:
            d = w4.setdefault(engine, {"ttft_s": [], "tpot_s": []})
            d["ttft_s"] += res.get("ttft_s") or []
            d["tpot_s"] += res.get("tpot_s") or []

    sweep: dict[str, dict[int, float]] = {}
    for engine, figs in figures.items():
        for key, n in (("W3", 1), ("C4", 4), ("C16", 16), ("W1", 64)):
            if key in figs and figs[key].get("tokens_per_s"):
                if args.quick and key != "W3":
                    n = len(next(w for w in wls if w.name == key).requests)
                sweep.setdefault(engine, {})[n] = figs[key]["tokens_per_s"]

    threads = {
        str(bench.workers[e].info.get("threads")): e
        for e in getattr(bench, "thread_engines", ["asyncllm"])
        if e in bench.workers and not bench.workers[e].failed
    }
    breakdown = _breakdown(bench, ceil, model)
    grammar = grammar_share(bench.traces.get("W1J"))
    kv = _kv(bench)
    summary = {
        "command": "python -m asyncllm bench " + " ".join(getattr(args, "argv", []) or []),
        "quick": args.quick,
        "elapsed_min": elapsed_s / 60,
        "machine": bench.machine,
        "ceilings": ceil,
        "ceiling_samples": bench.ceiling_samples,
        "model": model,
        "engines": {
            e: {
                "label": bench.label(e),
                "info": w.info,
                "failed": w.failed,
            }
            for e, w in bench.workers.items()
        },
        "workloads": {w.name: {"description": w.description, **w.params} for w in wls},
        "figures": figures,
        "skips": skips,
        "agreement": agreement,
        "agreement_detail": agreement_detail,
        "w5_outputs_equal_w1": w5_equal,
        "w4": w4,
        "sweep": sweep,
        "threads": threads,
        "breakdown": breakdown,
        "grammar": grammar,
        "kv": kv,
        "cold_start": cold,
        "repeats": args.repeats,
    }
    summary["targets"] = _targets(summary, args.threads)
    return summary


def output_agreement(
    ref: Sequence[Sequence[int]], outs: Sequence[Sequence[int]]
) -> dict[str, float]:
    """How far greedy outputs agree with reference ones, request by request: the fraction
    identical, and the mean fraction of each reference output before the first token that
    differs (1.0 when all are identical; 0.0 when every first token differs)."""
    same = sum(1 for a, b in zip(ref, outs, strict=True) if list(a) == list(b))
    prefix = []
    for a, b in zip(ref, outs, strict=True):
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        prefix.append(n / len(a) if a else 1.0)
    return {
        "identical": same / len(ref) if ref else 1.0,
        "prefix": statistics.fmean(prefix) if prefix else 1.0,
    }


def _breakdown(
    bench: Any, ceil: dict[str, dict[str, float]], model: dict[str, Any]
) -> dict[str, Any] | None:
    """Mean step-time components over W1's steps at its peak batch (all decodes)."""
    t = bench.traces.get("W1")
    if not t:
        return None
    steps = t["trace"]["steps"]
    peak = int(max((s.get("batch", 0) for s in steps), default=0))
    idx = [
        i
        for i, s in enumerate(steps[:-1])
        if s.get("batch") == peak and s.get("tokens") == peak and "dispatch" in s
    ]
    if not idx:
        return None
    comp: dict[str, list[float]] = {k: [] for k in (
        "cycle", "step", "schedule", "update", "prep", "forward", "sample", "dispatch", "detok",
        "post", "loop_cpu", "delivery", "other",
    )}  # fmt: skip
    for i in idx:
        s, nxt = steps[i], steps[i + 1]
        cycle = nxt["t0"] - s["t0"]
        prep = s.get("execute", 0) - s.get("forward", 0) - s.get("sample", 0)
        comp["cycle"].append(cycle)
        comp["step"].append(s["step"])
        comp["schedule"].append(s.get("schedule", 0))
        comp["update"].append(s.get("update", 0))
        comp["prep"].append(prep)
        comp["forward"].append(s.get("forward", 0))
        comp["sample"].append(s.get("sample", 0))
        comp["dispatch"].append(s["dispatch"])
        comp["detok"].append(s.get("detok", 0))
        comp["post"].append(s["dispatch"] - s.get("detok", 0))
        comp["loop_cpu"].append(nxt.get("loop_cpu", 0))
        comp["delivery"].append(max(0.0, nxt.get("loop_cpu", 0) - s["dispatch"]))
        comp["other"].append(cycle - s["step"] - s["dispatch"])
    mean = {k: statistics.fmean(v) for k, v in comp.items()}
    threads = str(bench.args.threads)
    c = ceil.get(threads) or next(iter(ceil.values()))
    fl = ceilings.floors(c, model["weight_bytes"], model["num_params"], int(peak))
    overhead = mean["schedule"] + mean["update"] + mean["prep"] + mean["sample"] + mean["detok"]
    return {
        "batch": peak,
        "steps": len(idx),
        "mean_s": mean,
        "floor": fl,
        "forward_over_floor": mean["forward"] / fl["floor_s"],
        "overhead_fraction": overhead / mean["cycle"],
        "threads": bench.args.threads,
        "loop_lag_ms": t.get("loop_lag_ms"),
    }


#: The grammar's parts of a traced step (see :class:`asyncllm.bench.asyncllm_engine.Tracer`).
GRAMMAR_PARTS = ("grammar_fill", "grammar_mask", "grammar_accept")


def grammar_share(trace: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the grammar costs in the steps of a traced constrained run (W1J) at its peak
    batch (decodes only, as :func:`_breakdown`): mean seconds per step of the bitmask fill,
    the sampler's mask and the matchers' accept, of the step (``LLMEngine.step``) and of
    sampling, and ``share``: (fill + mask) / step, issue 14's target (<= 5% at batch 64);
    ``share_with_accept`` adds the accept. None without a trace or a constrained step.
    """
    if not trace:
        return None
    steps = [s for s in trace["trace"]["steps"] if "grammar_fill" in s]
    peak = int(max((s.get("batch", 0) for s in steps), default=0))
    at = [s for s in steps if s.get("batch") == peak and s.get("tokens") == peak]
    if not at:
        return None
    mean = {k: statistics.fmean(s.get(k, 0.0) for s in at) for k in (*GRAMMAR_PARTS, "step")}
    mean["sample"] = statistics.fmean(s.get("sample", 0.0) for s in at)
    step = mean["step"]
    return {
        "batch": peak,
        "steps": len(at),
        "mean_s": mean,
        "share": (mean["grammar_fill"] + mean["grammar_mask"]) / step if step else None,
        "share_with_accept": sum(mean[k] for k in GRAMMAR_PARTS) / step if step else None,
        "tokens_per_s": trace.get("tokens_per_s"),
    }


def _kv(bench: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in bench.traces.items():
        if name not in ("W1", "W6"):  # the plotted ones
            continue
        tr = t["trace"]
        steps = tr["steps"]
        t0 = steps[0]["t0"] if steps else 0.0
        out[name] = {
            "block_size": tr["block_size"],
            "bytes_per_token": tr["bytes_per_token"],
            "time_s": [s["t0"] - t0 for s in steps],
            "blocks_held": [s["blocks_held"] for s in steps],
            "tokens_in_use": [s["tokens_in_use"] for s in steps],
            "prompt_lens": t["prompt_lens"],
            "max_tokens": t["max_tokens"],
        }
    return out


def _fig(summary: dict[str, Any], engine: str, key: str, metric: str) -> float | None:
    return summary["figures"].get(engine, {}).get(key, {}).get(metric)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _targets(s: dict[str, Any], threads: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    ceil = s["ceilings"].get(str(threads)) or {}
    model = s["model"]

    def add(name: str, value: float | None, goal: str, ok: bool | None, note: str = "") -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": ok, "note": note})

    w1 = _fig(s, "asyncllm", "W1", "tokens_per_s")
    # vLLM in asyncllm's precision where it ran so, else its first column.
    main = (s["engines"].get("asyncllm", {}).get("info") or {}).get("precision")
    vllm = _vllm_with(s, main) or "vllm"
    v1 = _fig(s, vllm, "W1", "tokens_per_s")
    r = _ratio(w1, v1)
    vprec = (s["engines"].get(vllm, {}).get("info") or {}).get("precision")
    note = "vLLM not measured in this run" if r is None else f"vLLM in {vprec}"
    add("W1 throughput / vLLM-CPU's", r, ">= 1.5", None if r is None else r >= 1.5, note)
    if ceil and w1:
        roof = ceil["matmul_gflops"] * 1e9 / (2 * model["num_params"])
        gf = ceil["matmul_gflops"]
        note = f"roofline {roof:.0f} tokens/s: {gf:.0f} GFLOP/s, {threads} thread(s)"
        add("W1 throughput / matmul roofline", w1 / roof, ">= 0.85", w1 / roof >= 0.85, note)
    tpot = _fig(s, "asyncllm", "W3", "tpot_mean_s")
    if ceil and tpot:
        floor = ceil["copy_gbs"] * 1e9 / model["weight_bytes"]
        frac = (1 / tpot) / floor
        note = (
            f"floor {floor:.1f} tokens/s: {ceil['copy_gbs']:.1f} GB/s copy, {threads} thread(s); "
            f"decode {1 / tpot:.1f} tokens/s"
        )
        add("W3 decode / bandwidth floor", frac, ">= 0.85", frac >= 0.85, note)
    ttft = _fig(s, "asyncllm", "W3", "ttft_mean_s")
    add("W3 TTFT (s)", ttft, "< 0.15", None if ttft is None else ttft < 0.15)
    w6 = _fig(s, "asyncllm", "W6", "tokens_per_s")
    h6 = _fig(s, "hf", "W6", "tokens_per_s")
    r = _ratio(w6, h6)
    add("W6 throughput / transformers static generate", r, ">= 2", None if r is None else r >= 2)
    b = s.get("breakdown")
    if b:
        f = b["overhead_fraction"]
        name = "scheduling + input prep + sampling + detokenization, share of the step"
        add(f"{name} at batch {b['batch']}", f, "< 0.10", f < 0.10)
    g = s.get("grammar")
    if g and g["share"] is not None:
        add(f"W1J grammar (bitmask fill + mask), share of the step at batch {g['batch']}",
            g["share"], "<= 0.05", g["share"] <= 0.05,
            f"{g['share_with_accept']:.1%} with the matchers' accept")  # fmt: skip
    lag = (s["figures"].get("asyncllm", {}).get("W4", {}).get("loop_lag_ms") or {}).get("p99")
    add("event-loop lag p99 under W4 (ms)", lag, "< 20", None if lag is None else lag < 20)
    _precision_targets(s, add)
    cs = (s.get("cold_start") or {}).get("cold_start_s")
    add("cold start to first token (s)", cs, "< 10", None if cs is None else cs < 10,
        "`python -m asyncllm generate`, cached default model")  # fmt: skip
    return out


def _vllm_with(s: dict[str, Any], precision: str | None) -> str | None:
    """The vLLM column (engine) that ran in ``precision`` ("bfloat16"), if one did."""
    for e in _order([e for e in s["engines"] if base_engine(e) == "vllm"]):
        info = s["engines"][e]["info"] or {}
        if not s["engines"][e]["failed"] and info.get("precision") == precision:
            return e
    return None


def _engine_with(s: dict[str, Any], dtype: str | None, quantization: str | None) -> str | None:
    """The asyncllm engine (column) of this precision, if it ran: the main one first."""
    for e in _order([e for e in s["engines"] if e.startswith("asyncllm")]):
        info = s["engines"][e]["info"] or {}
        if s["engines"][e]["failed"] or info.get("quantization") != quantization:
            continue
        if dtype is None or info.get("dtype") == dtype:
            return e
    return None


def _precision_targets(s: dict[str, Any], add: Callable[..., None]) -> None:
    """Issue 17's targets, where this run measured both sides: the GGUF (Q4_1) engine against
    llama.cpp on the same file and against float32, bfloat16 against float32 and vLLM."""
    f32 = _engine_with(s, "float32", None)
    bf16 = _engine_with(s, "bfloat16", None)
    gguf = _engine_with(s, None, "gguf")

    def cmp(name: str, a: str | None, b: str | None, key: str, metric: str, goal: str) -> None:
        if a is None or b is None or a == b:
            return
        r = _ratio(_fig(s, a, key, metric), _fig(s, b, key, metric))
        if r is None:
            return
        op, bound = goal.split()
        add(name, r, goal, r <= float(bound) if op == "<=" else r >= float(bound))

    cmp("W3 TPOT, asyncllm Q4_1 (gguf) / llama.cpp's", gguf, "llamacpp", "W3", "tpot_mean_s",
        "<= 1")  # fmt: skip
    cmp("W3 TTFT, asyncllm Q4_1 (gguf) / llama.cpp's", gguf, "llamacpp", "W3", "ttft_mean_s",
        "<= 1")  # fmt: skip
    cmp("W1 tokens/s, asyncllm Q4_1 (gguf) / float32", gguf, f32, "W1", "tokens_per_s", ">= 1")
    cmp("W1 tokens/s, asyncllm Q4_1 (gguf) / llama.cpp's", gguf, "llamacpp", "W1",
        "tokens_per_s", ">= 3")  # fmt: skip
    cmp("W1 tokens/s, asyncllm bfloat16 / float32", bf16, f32, "W1", "tokens_per_s", ">= 1.6")
    cmp("W3 TPOT, asyncllm bfloat16 / float32", bf16, f32, "W3", "tpot_mean_s", "<= 0.625")
    vllm_bf16 = _vllm_with(s, "bfloat16")
    cmp("W1 tokens/s, asyncllm bfloat16 / vLLM-CPU bfloat16", bf16, vllm_bf16, "W1",
        "tokens_per_s", ">= 1")  # fmt: skip
    cmp("W3 TPOT, asyncllm bfloat16 / vLLM-CPU bfloat16", bf16, vllm_bf16, "W3", "tpot_mean_s",
        "<= 1")  # fmt: skip
    cmp("W3 peak RSS, asyncllm Q4_1 (gguf) / float32", gguf, f32, "W3", "rss_mb_max", "<= 0.4")


# ---------------------------------------------------------------------------------- markdown


def _f(x: Any, digits: int = 1, unit: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


ROWS: list[tuple[str, str, str, int, float]] = [
    # (workload key, label, metric, digits, scale)
    ("W1", "W1 tokens/s", "tokens_per_s", 1, 1),
    ("W1", "W1 wall s", "wall_s", 1, 1),
    ("W1", "W1 RSS MiB", "rss_mb", 0, 1),
    ("W1J", "W1J tokens/s (JSON schema)", "tokens_per_s", 1, 1),
    ("W1J", "W1J generated tokens", "generated_tokens", 0, 1),
    ("W2/on", "W2 wall s, prefix cache on", "wall_s", 2, 1),
    ("W2/on", "W2 mean TTFT s, cache on", "ttft_mean_s", 3, 1),
    ("W2/off", "W2 wall s, cache off", "wall_s", 2, 1),
    ("W2/off", "W2 mean TTFT s, cache off", "ttft_mean_s", 3, 1),
    ("W3", "W3 TTFT s", "ttft_mean_s", 3, 1),
    ("W3", "W3 TPOT ms", "tpot_mean_s", 1, 1000),
    ("W3", "W3 decode tokens/s", "tpot_mean_s", 1, -1),
    ("W4", "W4 TTFT p50 / p99 s", "ttft_p50_s|ttft_p99_s", 3, 1),
    ("W4", "W4 TPOT p50 / p99 ms", "tpot_p50_s|tpot_p99_s", 1, 1000),
    ("W4", "W4 completed requests/s", "requests_per_s", 2, 1),
    ("W4", "W4 event-loop lag p99 ms", "loop_lag_ms.p99", 1, 1),
    ("W5", "W5 tokens/s", "tokens_per_s", 1, 1),
    ("W5", "W5 preemptions", "stats.num_preemptions", 0, 1),
    (
        "W5",
        "W5 blocks offloaded / restored",
        "stats.num_swapped_out_blocks|stats.num_swapped_in_blocks",
        0,
        1,
    ),
    ("W6", "W6 tokens/s", "tokens_per_s", 1, 1),
    ("W6", "W6 wall s", "wall_s", 1, 1),
    ("C4", "C4 tokens/s (4 at once; 1 with --quick)", "tokens_per_s", 1, 1),
    ("C16", "C16 tokens/s (16 at once; 4 with --quick)", "tokens_per_s", 1, 1),
]


def _cell(
    fig: dict[str, Any] | None, metric: str, digits: int, scale: float, repeats: int = 1
) -> str:
    """A table cell: the metric(s) of ``fig``; † marks a median of fewer than ``repeats``."""
    if not fig:
        return "–"
    vals = []
    for m in metric.split("|"):
        v: Any = fig
        for part in m.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if v is None:
            vals.append("–")
            continue
        v = (1 / v) if scale == -1 and v else v * scale
        vals.append(f"{v:.{digits}f}" if digits else f"{v:.0f}")
    mark = " †" if fig.get("runs", repeats) < repeats and any(v != "–" for v in vals) else ""
    return " / ".join(vals) + mark


def markdown(s: dict[str, Any], plots: Sequence[str], out: pathlib.Path) -> str:
    m = s["machine"]
    model = s["model"]
    engines = _order(
        [e for e in s["engines"] if not s["engines"][e]["failed"] and e in s["figures"]]
    )
    lines = [
        f"# asyncllm benchmark{' (quick: smoke-test sizes, not comparable)' if s['quick'] else ''}",
        "",
        f"Command: `{s['command'].strip()}` ({s['elapsed_min']:.0f} min).",
        "",
        f"Machine: {m['cores']} cores, {m['processor']} ({', '.join(m['simd'])}), "
        f"{m['memory_gib']} GiB; Python {m['python']}, torch {m['torch']} "
        f"(CPU capability {m['torch_cpu_capability']}); load average at start "
        f"{m['load_avg_1m']:.2f}.",
        f"Model: {model['architecture']} {model['num_params'] / 1e6:.1f} M parameters, float32 "
        f"({model['weight_bytes'] / 1e6:.0f} MB of weights), KV {model['bytes_per_token']} "
        "bytes/token.",
        "",
        "Ceilings measured by the harness (best of the samples at the start and the end of the "
        "run):",
        "",
        "| torch threads | copy bandwidth | matmul (1024³ float32) |",
        "|---|---|---|",
    ]
    for t, c in sorted(s["ceilings"].items()):
        lines.append(f"| {t} | {c['copy_gbs']:.1f} GB/s | {c['matmul_gflops']:.0f} GFLOP/s |")
    lines += [
        "",
        "## Engines",
        "",
        "| engine | version | threads | precision | weights MB | settings | start s | RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for e in _order(list(s["engines"])):
        info = s["engines"][e]["info"] or {}
        figs = s["figures"].get(e, {})
        settings = next((f.get("settings") for f in figs.values() if f.get("settings")), None) or {}
        st = ", ".join(f"{k} {v}" for k, v in settings.items() if k not in ("threads", "dtype"))
        failed = s["engines"][e]["failed"]
        label = s["engines"][e]["label"]
        wb = info.get("weight_bytes")
        lines.append(
            f"| {label} | {info.get('version', '–')} | {info.get('threads', '–')} "
            f"| {info.get('precision') or settings.get('dtype') or '–'} "
            f"| {_f(wb / 1e6 if wb else None, 0)} "
            f"| {st or ('failed: ' + failed if failed else '–')} | {_f(info.get('start_s'), 0)} "
            f"| {_f(max((f.get('rss_mb_max') or 0 for f in figs.values()), default=None), 0)} |"
        )
        if info.get("tokenizer_ids_match"):
            tok = ", ".join(f"{k} {v}" for k, v in info["tokenizer_ids_match"].items())
            notes.append(f"{label}: its tokenizer gives transformers' prompt ids for {tok}.")
    lines += ["", *notes] if notes else []
    lines += [
        "",
        f"## Results (median of {s['repeats']} counted runs; † one run: W4, W5, and a peer "
        "whose run took longer than --peer-run-budget)",
        "",
        "| workload | " + " | ".join(s["engines"][e]["label"] for e in engines) + " |",
        "|---|" + "---|" * len(engines),
    ]
    for key, label, metric, digits, scale in ROWS:
        cells = [
            _cell(s["figures"].get(e, {}).get(key), metric, digits, scale, s["repeats"])
            for e in engines
        ]
        if all(c == "–" for c in cells):
            continue
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    # Ratios, same run.
    peers = [e for e in engines if not e.startswith("asyncllm")]
    if peers:
        lines += [
            "",
            "Ratios asyncllm ÷ peer (throughput; same run, runs alternating):",
            "",
            "| workload | " + " | ".join(s["engines"][p]["label"] for p in peers) + " |",
            "|---|" + "---|" * len(peers),
        ]
        for key in ("W1", "W1J", "W2/on", "W2/off", "W3", "W6", "C4", "C16"):
            a = _fig(s, "asyncllm", key, "tokens_per_s")
            cells = [_f(_ratio(a, _fig(s, p, key, "tokens_per_s")), 2, "×") for p in peers]
            if all(c == "–" for c in cells):
                continue
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    w2 = s["figures"].get("asyncllm", {}).get("W2/on")
    if w2 and w2.get("stats"):
        lines += [
            "",
            f"W2 prefix-cache hit rate (asyncllm): "
            f"{w2['stats'].get('prefix_cache_hit_rate', 0):.1%} of prompt tokens.",
        ]
    vw2 = s["figures"].get("vllm", {}).get("W2/on")
    if vw2 and vw2.get("cached_prompt_tokens") is not None:
        lines.append(f"vLLM W2 cached prompt tokens per run: {vw2['cached_prompt_tokens']:.0f}.")
    if s["w5_outputs_equal_w1"] is not None:
        lines.append(f"W5 greedy outputs equal W1's: {_f(s['w5_outputs_equal_w1'])}.")
    detail = s.get("agreement_detail") or []
    if detail:
        lines += [
            "",
            "Greedy outputs against asyncllm's (same prompt ids; other precisions and kernels "
            "may differ after a near tie, which is no error):",
            "",
            "| workload | engine | against | requests identical | mean share before the "
            "first difference |",
            "|---|---|---|---|---|",
        ]
        label = {e: v["label"] for e, v in s["engines"].items()}
        for d in sorted(detail, key=lambda d: (d["workload"], d["engine"], d["reference"])):
            lines.append(
                f"| {d['workload']} | {label.get(d['engine'], d['engine'])} "
                f"| {label.get(d['reference'], d['reference'])} | {d['identical']:.0%} "
                f"| {d['prefix']:.0%} |"
            )
    lines += ["", "## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
    for t in s["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(f"| {t['target']}{note} | {_f(t['value'], 3)} | {t['goal']} | {met} |")
    b = s.get("breakdown")
    if b:
        mean = b["mean_s"]
        cyc = mean["cycle"]
        lines += [
            "",
            f"## Step time at W1's peak batch ({b['batch']} decodes, {b['steps']} steps, "
            f"{b['threads']} torch thread(s))",
            "",
            "| part | ms per step | share |",
            "|---|---|---|",
        ]
        for k, label in (
            ("schedule", "scheduling (schedule)"),
            ("update", "scheduling (update from output, stop checks, block frees)"),
            ("prep", "input preparation (tensors, attention plan)"),
            ("forward", "model forward"),
            ("sample", "sampling"),
            ("detok", "detokenization"),
            ("post", "posting to request states"),
            ("other", "handoff between loop and worker thread, inbox"),
        ):
            lines.append(f"| {label} | {mean[k] * 1e3:.2f} | {mean[k] / cyc:.1%} |")
        lines.append(f"| **step cycle** | **{cyc * 1e3:.1f}** | 100% |")
        lines += [
            "",
            f"Delivery to the {b['batch']} consumers runs on the event loop while the next step "
            f"computes "
            f"(main thread CPU {mean['loop_cpu'] * 1e3:.2f} ms per step, of which "
            f"{mean['delivery'] * 1e3:.2f} ms outside dispatch).",
            f"Forward {mean['forward'] * 1e3:.1f} ms vs floor {b['floor']['floor_s'] * 1e3:.1f} ms "
            f"(bandwidth {b['floor']['bandwidth_s'] * 1e3:.1f} ms, compute "
            f"{b['floor']['compute_s'] * 1e3:.1f} ms): {b['forward_over_floor']:.2f}× the floor.",
        ]
    lines += grammar_lines(
        s.get("grammar"),
        _fig(s, "asyncllm", "W1", "tokens_per_s"),
        _fig(s, "asyncllm", "W1J", "tokens_per_s"),
    )
    th = s.get("threads") or {}
    if len(th) > 1:
        lines += [
            "",
            "## Torch threads (asyncllm, same run)",
            "",
            "| workload | " + " | ".join(f"{t} thread(s)" for t in sorted(th)) + " |",
            "|---|" + "---|" * len(th),
        ]
        for key, label, metric, digits, scale in (
            ("W1", "W1 tokens/s", "tokens_per_s", 1, 1),
            ("W3", "W3 TTFT s", "ttft_mean_s", 3, 1),
            ("W3", "W3 decode tokens/s", "tpot_mean_s", 1, -1),
            ("W4", "W4 TTFT p50 / p99 s", "ttft_p50_s|ttft_p99_s", 3, 1),
            ("W4", "W4 TPOT p50 / p99 ms", "tpot_p50_s|tpot_p99_s", 1, 1000),
            ("W4", "W4 event-loop lag p99 ms", "loop_lag_ms.p99", 1, 1),
        ):
            cells = [
                _cell(s["figures"].get(th[t], {}).get(key), metric, digits, scale)
                for t in sorted(th)
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if s["skips"]:
        lines += ["", "## Skipped", ""]
        seen = set()
        for sk in s["skips"]:
            k = (sk["engine"], sk["workload"], sk["reason"])
            if k in seen:
                continue
            seen.add(k)
            who = s["engines"].get(sk["engine"], {}).get("label") or sk.get("label")
            lines.append(f"- {who or sk['engine']}, {sk['workload']}: {sk['reason']}")
    if s.get("cold_start", {}).get("samples_s"):
        lines += [
            "",
            "Cold start (process start to first streamed token, `python -m asyncllm generate`): "
            + ", ".join(f"{x:.1f}" for x in s["cold_start"]["samples_s"])
            + " s.",
        ]
    if plots:
        lines += ["", "## Plots", ""]
        for p in plots:
            rel = pathlib.Path(p)
            with contextlib.suppress(ValueError):
                rel = rel.resolve().relative_to(out.resolve())
            lines.append(f"![{rel.stem}]({rel})")
    return "\n".join(lines) + "\n"


def grammar_lines(g: dict[str, Any] | None, w1: float | None, w1j: float | None) -> list[str]:
    """The report's structured-outputs section: W1J's tokens/s beside W1's (asyncllm, counted
    runs) and the grammar's parts of the traced W1J step (:func:`grammar_share`)."""
    if g is None and w1j is None:
        return []
    lines = ["", "## Structured outputs (W1J: W1 with every request under one JSON schema)", ""]
    if w1j is not None:
        r = _ratio(w1j, w1)
        vs = f" against W1's {w1:.1f} ({r:.2f}×)" if w1 is not None and r is not None else ""
        lines.append(f"asyncllm W1J: {w1j:.1f} tokens/s{vs}.")
    if g is not None:
        mean = g["mean_s"]
        lines += [
            "",
            f"Traced W1J run ({g['steps']} steps at batch {g['batch']}, decodes only):",
            "",
            "| part | ms per step | share of the step |",
            "|---|---|---|",
        ]
        for k, label in (
            ("grammar_fill", "token bitmask fill (GrammarMatchers.fill)"),
            ("grammar_mask", "sampler's mask (_apply_grammar)"),
            ("grammar_accept", "matchers' accept (GrammarMatchers.accept)"),
            ("sample", "sampling, mask included"),
        ):
            lines.append(f"| {label} | {mean[k] * 1e3:.2f} | {mean[k] / mean['step']:.1%} |")
        lines += [
            f"| **step** | **{mean['step'] * 1e3:.1f}** | 100% |",
            "",
            f"Grammar share (fill + mask) {g['share']:.1%} of the step; with the accept "
            f"{g['share_with_accept']:.1%} (target: at most 5%).",
        ]
    return lines


# ---------------------------------------------------------------------------------- plots


def make_plots(s: dict[str, Any], bench: Any, img: pathlib.Path) -> list[str]:
    """PNG plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    labels = {e: v["label"] for e, v in s["engines"].items()}
    colors = {"asyncllm": "C0", "vllm": "C1", "hf": "C2", "hf_cb": "C3", "llamacpp": "C6"}

    def color(e: str) -> str:
        return colors.get(e, "C4" if base_engine(e) == "asyncllm" else "C5")

    # 1. Throughput against concurrent requests.
    if s["sweep"]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for e in _order(list(s["sweep"])):
            pts = sorted((int(k), v) for k, v in s["sweep"][e].items())
            ls = "--" if e.startswith("asyncllm-t") else "-"
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", label=labels.get(e, e), color=color(e), linestyle=ls)
        ax.set_xscale("log", base=2)
        xs = sorted({int(k) for d in s["sweep"].values() for k in d})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent requests (W3, C4, C16, W1: all submitted at once)")
        ax.set_ylabel("generated tokens / s")
        ax.set_title("Throughput against concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, img / "throughput_vs_concurrency.png"))

    # 2. TTFT and TPOT distributions under W4.
    if s["w4"]:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for e in _order(list(s["w4"])):
            d = s["w4"][e]
            for ax, key, scale in ((axes[0], "ttft_s", 1.0), (axes[1], "tpot_s", 1e3)):
                xs = sorted(x * scale for x in d[key])
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ls = "--" if e.startswith("asyncllm-t") else "-"
                    lab = f"{labels.get(e, e)} (n={len(xs)})"
                    ax.step(xs, ys, where="post", label=lab, color=color(e), linestyle=ls)
        w4 = s["workloads"].get("W4", {})
        axes[0].set_xlabel("TTFT (s)")
        axes[1].set_xlabel("TPOT, mean per request (ms)")
        for ax in axes:
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
        fig.suptitle(f"W4: {w4.get('description', '')}", fontsize=10)
        paths.append(_save(fig, img / "w4_latency_cdf.png"))

    # 3. KV cache held against tokens in use.
    if s["kv"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        ax = axes[0]
        top = 0.0
        for name, style in (("W1", "C0"), ("W6", "C1")):
            k = s["kv"].get(name)
            if not k:
                continue
            bpt = k["bytes_per_token"] / 2**20
            held = [b * k["block_size"] * bpt for b in k["blocks_held"]]
            used = [u * bpt for u in k["tokens_in_use"]]
            ax.plot(k["time_s"], held, color=style, label=f"{name}: held by asyncllm (blocks)")
            ax.plot(k["time_s"], used, color=style, linestyle=":", label=f"{name}: tokens in use")
            top = max(top, max(held, default=0))
        ax.set_xlabel("time in the run (s)")
        ax.set_ylabel("KV cache (MiB)")
        ax.set_title("asyncllm: KV memory held vs in use, per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1]
        k = s["kv"].get("W6") or s["kv"].get("W1")
        name = "W6" if s["kv"].get("W6") else "W1"
        if k:
            bpt = k["bytes_per_token"] / 2**20
            held = [b * k["block_size"] for b in k["blocks_held"]]
            used = k["tokens_in_use"]
            ax.plot([u * bpt for u in used], [h * bpt for h in held], ".", ms=3, color="C0",
                    label="asyncllm (paged, 16-token blocks)")  # fmt: skip
            # The same requests in one static batch with left padding (what transformers'
            # generate holds): batch x (longest prompt + step) until the longest is done.
            p, m = k["prompt_lens"], k["max_tokens"]
            pmax, steps = max(p), max(m)
            sh = [len(p) * (pmax + t) for t in range(1, steps + 1)]
            su = [
                sum(pi + min(t, mi) for pi, mi in zip(p, m, strict=True))
                for t in range(1, steps + 1)
            ]
            ax.plot([u * bpt for u in su], [h * bpt for h in sh], "-", color="C2",
                    label="static batch, left padding (computed)")  # fmt: skip
            lim = max(max(sh) * bpt, max(held) * bpt) * 1.05
            ax.plot([0, lim], [0, lim], color="gray", lw=0.8, label="no waste")
            ax.set_xlim(0, lim)
            ax.set_ylim(0, lim)
        ax.set_xlabel("tokens in use (MiB of K/V)")
        ax.set_ylabel("KV memory held (MiB)")
        ax.set_title(f"{name}: held against in use")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, img / "kv_cache_waste.png"))

    # 4. Step-time breakdown.
    b = s.get("breakdown")
    if b:
        mean = b["mean_s"]
        parts = [
            ("scheduling", mean["schedule"] + mean["update"]),
            ("input prep", mean["prep"]),
            ("forward", mean["forward"]),
            ("sampling", mean["sample"]),
            ("detokenization", mean["detok"]),
            ("posting", mean["post"]),
            ("handoff", max(mean["other"], 0)),
        ]
        fig, ax = plt.subplots(figsize=(9, 3.0))
        left = 0.0
        for i, (name, v) in enumerate(parts):
            ax.barh([0], [v * 1e3], left=left, color=f"C{i}", label=f"{name} {v * 1e3:.1f} ms")
            left += v * 1e3
        ax.axvline(
            b["floor"]["floor_s"] * 1e3,
            color="k",
            ls="--",
            lw=1,
            label=f"forward floor {b['floor']['floor_s'] * 1e3:.0f} ms",
        )
        ax.set_yticks([])
        ax.set_title(f"W1 step at batch {b['batch']} ({b['threads']} torch thread(s)), ms per step")
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
        ax.set_ylim(-0.6, 0.6)
        paths.append(_save(fig, img / "w1_step_breakdown.png"))
    return paths


def _save(fig: Any, path: pathlib.Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return str(path)


__all__ = ["build_summary", "make_plots", "markdown", "percentile"]
