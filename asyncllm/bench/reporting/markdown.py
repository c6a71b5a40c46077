"""A benchmark run's ``summary.json`` as ``report.md``."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Sequence
from typing import Any

from asyncllm.bench.reporting.summary import _fig, _order, _ratio


def _f(x: Any, digits: int = 1, unit: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


_SPEC = "stats.spec_num_accepted_tokens|stats.spec_num_draft_tokens|stats.spec_num_steps"
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
    ("W7", "W7 TTFT s", "ttft_mean_s", 3, 1),
    ("W7", "W7 TPOT ms", "tpot_mean_s", 1, 1000),
    *(
        (w, f"{w} speculation: accepted / proposed tokens, verifications", _SPEC, 0, 1)
        for w in ("W3", "W7")
    ),
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
    if all(v == "–" for v in vals):
        return "–"
    mark = " †" if fig.get("runs", repeats) < repeats else ""
    return " / ".join(vals) + mark


def markdown(s: dict[str, Any], plots: Sequence[str], out: pathlib.Path) -> str:
    """``report.md`` from a summary (:func:`asyncllm.bench.reporting.summary.build_summary`);
    ``plots`` are the plot files, linked relative to ``out``."""
    engines = _order(
        [e for e in s["engines"] if not s["engines"][e]["failed"] and e in s["figures"]]
    )
    lines = [
        *_head(s),
        *_engines(s),
        *_results(s, engines),
        *_notes(s),
        *_targets_and_breakdown(s),
        *grammar_lines(
            s.get("grammar"),
            _fig(s, "asyncllm", "W1", "tokens_per_s"),
            _fig(s, "asyncllm", "W1J", "tokens_per_s"),
        ),
        *_threads(s),
        *_tail(s, plots, out),
    ]
    return "\n".join(lines) + "\n"


def _head(s: dict[str, Any]) -> list[str]:
    """The title, the command, the machine, the model and the ceilings."""
    m = s["machine"]
    model = s["model"]
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
        "| torch threads | copy bandwidth | matmul (1024³ float32) | matmul (1024³ bfloat16) |",
        "|---|---|---|---|",
    ]
    for t, c in sorted(s["ceilings"].items()):
        bf16 = c.get("bf16_matmul_gflops")
        lines.append(
            f"| {t} | {c['copy_gbs']:.1f} GB/s | {c['matmul_gflops']:.0f} GFLOP/s | "
            + ("–" if bf16 is None else f"{bf16:.0f} GFLOP/s")
            + " |"
        )
    return lines


def _engines(s: dict[str, Any]) -> list[str]:
    """Each engine's version, threads, precision, settings and memory."""
    lines: list[str] = []
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
    return lines


def _results(s: dict[str, Any], engines: list[str]) -> list[str]:
    """The figures of each workload per engine, and the ratios to the peers."""
    lines: list[str] = []
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
        for key in ("W1", "W1J", "W2/on", "W2/off", "W3", "W6", "W7", "C4", "C16"):
            a = _fig(s, "asyncllm", key, "tokens_per_s")
            cells = [_f(_ratio(a, _fig(s, p, key, "tokens_per_s")), 2, "×") for p in peers]
            if all(c == "–" for c in cells):
                continue
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def _notes(s: dict[str, Any]) -> list[str]:
    """Prefix-cache hits, W5 against W1, and greedy agreement with asyncllm's outputs."""
    lines: list[str] = []
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
    return lines


def _targets_and_breakdown(s: dict[str, Any]) -> list[str]:
    """The targets, and the step time's parts at W1's peak batch."""
    lines: list[str] = []
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
            ("post", "event loop between steps (detokenization, stop strings, posting, inbox)"),
            ("other", "the trace's own bookkeeping (its step observer)"),
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
            f"(bandwidth {b['floor']['bandwidth_s'] * 1e3:.1f} ms for "
            f"{b['floor'].get('weight_bytes', 0) / 1e6:.0f} MB of weights, compute "
            f"{b['floor']['compute_s'] * 1e3:.1f} ms at the {b['floor'].get('dtype', 'float32')} "
            f"matmul ceiling): {b['forward_over_floor']:.2f}× the floor.",
        ]
        fl = b["floor"]
        if fl.get("kv_bytes"):
            lines.append(
                f"Its attention reads {fl['kv_bytes'] / 1e6:.0f} MB of KV cache per step "
                f"({fl['kv_s'] * 1e3:.1f} ms at copy bandwidth); with them the floor is "
                f"{fl['floor_with_kv_s'] * 1e3:.1f} ms: "
                f"{b['forward_over_floor_with_kv']:.2f}× that."
            )
    return lines


def _threads(s: dict[str, Any]) -> list[str]:
    """asyncllm at each torch thread count."""
    lines: list[str] = []
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
    return lines


def _tail(s: dict[str, Any], plots: Sequence[str], out: pathlib.Path) -> list[str]:
    """What was skipped and why, the cold start, and the plots."""
    lines: list[str] = []
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
    return lines


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
            ("grammar_mask", "sampler's check, mask, re-argmax (_constrained_argmax)"),
            ("grammar_accept", "matchers' accept (GrammarMatchers.accept)"),
            ("sample", "sampling, mask included"),
        ):
            if k in mean:
                lines.append(f"| {label} | {mean[k] * 1e3:.2f} | {mean[k] / mean['step']:.1%} |")
        lines += [
            f"| **step** | **{mean['step'] * 1e3:.1f}** | 100% |",
            "",
            f"Grammar share (fill{' + mask' * ('grammar_mask' in mean)}) {g['share']:.1%} of "
            f"the step; with the accept "
            f"{g['share_with_accept']:.1%} (target: at most 5%).",
        ]
        lines += compile_lines(g.get("compiler"))
    return lines


def compile_lines(c: dict[str, float] | None) -> list[str]:
    """The W1J engine's grammar compiles (``GrammarCompiler.stats``): the schema's compile
    and the cache hits of every later request under it (issue 14: a cached schema adds no
    compile time)."""
    if not c or not c["num_compiled"]:
        return []
    hits = int(c["num_cache_hits"])
    per_hit = f", {1e6 * c['hit_s'] / hits:.0f} µs each" if hits else ""
    return [
        "",
        f"Grammar compile (W1J_SCHEMA, xgrammar): {int(c['num_compiled'])} compile(s), "
        f"{1e3 * c['compile_s'] / c['num_compiled']:.1f} ms each (first request; plus "
        f"{1e3 * c['backend_s']:.0f} ms once for the tokenizer's vocabulary); {hits} cache "
        f"hits{per_hit}, no compile.",
    ]


# ---------------------------------------------------------------------------------- plots
