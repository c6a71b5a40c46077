"""A benchmark run's records as ``summary.json``: medians, agreement, step breakdown, targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from asyncllm.bench import ceilings
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

    figures = _figures(bench)
    skips = _skips(bench)
    agreement, agreement_detail = _agreement(bench)
    w5_equal = None
    if ("asyncllm", "W5") in bench.outputs and ("asyncllm", "W1") in bench.outputs:
        w5_equal = bench.outputs[("asyncllm", "W5")] == bench.outputs[("asyncllm", "W1")]

    w4 = _w4(bench)
    sweep = _sweep(figures, wls, args.quick)
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


def _figures(bench: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """Medians over counted runs, per engine and workload (variant)."""
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

    return figures


def _skips(bench: Any) -> list[dict[str, Any]]:
    """What was skipped (per run, and whole engines), with the reasons."""
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

    return skips


def _agreement(bench: Any) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Greedy agreement with asyncllm's outputs (first counted run of each); a peer is also
    compared with each asyncllm precision variant (llama.cpp's Q4_1 with asyncllm's gguf)."""
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
    return agreement, agreement_detail


def _w4(bench: Any) -> dict[str, dict[str, list[float]]]:
    """W4's TTFT and TPOT distributions (all counted runs' requests)."""
    w4: dict[str, dict[str, list[float]]] = {}
    for (engine, wl, _variant), rs in bench.raw_runs.items():
        if wl != "W4":
            continue
        for res in rs:
            d = w4.setdefault(engine, {"ttft_s": [], "tpot_s": []})
            d["ttft_s"] += res.get("ttft_s") or []
            d["tpot_s"] += res.get("tpot_s") or []

    return w4


def _sweep(
    figures: dict[str, dict[str, dict[str, Any]]], wls: Sequence[Any], quick: bool
) -> dict[str, dict[int, float]]:
    """tokens/s against the number of requests submitted at once (W3, C4, C16, W1)."""
    sweep: dict[str, dict[int, float]] = {}
    for engine, figs in figures.items():
        for key, n in (("W3", 1), ("C4", 4), ("C16", 16), ("W1", 64)):
            if key in figs and figs[key].get("tokens_per_s"):
                if quick and key != "W3":
                    n = len(next(w for w in wls if w.name == key).requests)
                sweep.setdefault(engine, {})[n] = figs[key]["tokens_per_s"]

    return sweep


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
    info = bench.workers["asyncllm"].info if "asyncllm" in bench.workers else {}
    weight_bytes = info.get("weight_bytes") or model["weight_bytes"]
    dtype = info.get("dtype", "float32")
    kv_tokens = statistics.fmean(steps[i].get("tokens_in_use", 0.0) for i in idx)
    kv_bytes = kv_tokens * t["trace"].get("bytes_per_token", 0)
    fl = ceilings.floors(c, weight_bytes, model["num_params"], int(peak), dtype, kv_bytes)
    overhead = mean["schedule"] + mean["update"] + mean["prep"] + mean["sample"] + mean["detok"]
    return {
        "batch": peak,
        "steps": len(idx),
        "mean_s": mean,
        "floor": {**fl, "dtype": dtype, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes},
        "forward_over_floor": mean["forward"] / fl["floor_s"],
        "forward_over_floor_with_kv": mean["forward"] / fl["floor_with_kv_s"],
        "overhead_fraction": overhead / mean["cycle"],
        "threads": bench.args.threads,
        "loop_lag_ms": t.get("loop_lag_ms"),
    }


#: The grammar's parts of a traced step (see :class:`asyncllm.bench.asyncllm_engine.Tracer`).
GRAMMAR_PARTS = ("grammar_fill", "grammar_mask", "grammar_accept")


def grammar_share(trace: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the grammar costs in the steps of a traced constrained run (W1J) at its peak
    batch (decodes only, as :func:`_breakdown`): mean seconds per step of the bitmask fill,
    the sampler's check and mask and the matchers' accept, of the step and of
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
    parts = [k for k in GRAMMAR_PARTS if any(k in s for s in at)]
    mean = {k: statistics.fmean(s.get(k, 0.0) for s in at) for k in (*parts, "step", "sample")}
    step = mean["step"]
    share = mean["grammar_fill"] + mean.get("grammar_mask", 0.0)  # no mask: no row was checked
    return {
        "batch": peak,
        "steps": len(at),
        "mean_s": mean,
        "share": share / step if step else None,
        "share_with_accept": sum(mean[k] for k in parts) / step if step else None,
        "tokens_per_s": trace.get("tokens_per_s"),
        "compiler": trace["trace"].get("grammar_compiler"),
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
    info = s["engines"].get("asyncllm", {}).get("info") or {}
    if ceil and w1:
        gf = ceilings.gflops(ceil, info.get("dtype"))
        roof = gf * 1e9 / (2 * model["num_params"])
        note = (
            f"roofline {roof:.0f} tokens/s: {gf:.0f} GFLOP/s {info.get('dtype', 'float32')}, "
            f"{threads} thread(s)"
        )
        add("W1 throughput / matmul roofline", w1 / roof, ">= 0.85", w1 / roof >= 0.85, note)
    tpot = _fig(s, "asyncllm", "W3", "tpot_mean_s")
    if ceil and tpot:
        floor = ceil["copy_gbs"] * 1e9 / (info.get("weight_bytes") or model["weight_bytes"])
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
        name = "scheduling + input prep + sampling, share of the step (detokenization: event loop)"
        add(f"{name} at batch {b['batch']}", f, "< 0.10", f < 0.10)
    g = s.get("grammar")
    if g and g["share"] is not None:
        add(f"W1J grammar (bitmask fill + the sampler's check and mask), share of the step at "
            f"batch {g['batch']}",
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
