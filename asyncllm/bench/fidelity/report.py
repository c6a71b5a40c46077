"""The fidelity harness's ``fidelity.json`` (:func:`summary`) and its report section
``fidelity.md`` (:func:`markdown`); see :mod:`asyncllm.bench.fidelity.measures`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any


def summary(
    args: argparse.Namespace,
    data: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    machine: dict[str, Any],
    elapsed_s: float,
) -> dict[str, Any]:
    """The run as one JSON object: the command, machine, model, the reference's figures,
    the questions with the reference's answers, and every path's record."""
    import transformers

    from asyncllm.bench.fidelity.measures import perplexity

    ref = data["ref"]
    tok = data["tokenizer"]
    source = data["model_dir"] / "asyncllm_source.json"
    gguf = json.loads(source.read_text()).get("gguf_file") if source.is_file() else None
    return {
        "command": "python -m asyncllm bench " + " ".join(getattr(args, "argv", None) or []),
        "elapsed_s": elapsed_s,
        "quick": bool(args.quick),
        "machine": machine,
        "model": {"name": args.model, "dir": str(data["model_dir"]), "gguf_file": gguf},
        "reference": {
            "engine": f"transformers {transformers.__version__}, float32, eager attention",
            "ppl": perplexity([w["logprobs"] for w in ref["windows"]]),
            "text": data["text_file"].name,
            "text_tokens": data["text_tokens"],
            "window": data["window"],
            "windows": len(data["windows"]),
            "positions": sum(len(w["logprobs"]) for w in ref["windows"]),
            "answer_tokens": data["n"],
            "eos": data["eos"],
            "computed_s": ref["computed_s"],
            "key": ref["key"],
        },
        "questions": [
            {"text": q, "reference": tok.decode(a["ids"])}
            for q, a in zip(data["questions"], ref["answers"], strict=True)
        ],
        "paths": list(rows),
    }


def _what_ran(row: dict[str, Any]) -> str:
    s = row.get("settings") or {}
    parts = [str(row.get("precision") or s.get("dtype") or "?")]
    if s.get("attention"):
        parts.append(f"attention {s['attention']}")
    if s.get("compile"):
        parts.append(f"compile {s['compile']}")
    return "; ".join(parts)


def table(s: dict[str, Any]) -> list[str]:
    """The table: one row per path (the reference first), or why a path has no figures."""
    ref = s["reference"]
    lines = [
        "| path | what ran | perplexity | vs reference | top-1 agreement | greedy equal "
        "| mean abs. Δ log-prob |",
        "|---|---|---|---|---|---|---|",
        f"| reference | {ref['engine']} | {ref['ppl']:.4f} | – | – | – | – |",
    ]
    for r in s["paths"]:
        name = r["variant"]
        if "skipped" in r:
            lines.append(f"| {name} | {r['skipped']} | – | – | – | – | – |")
            continue
        lines.append(
            f"| {name} | {_what_ran(r)} | {r['ppl']:.4f} | {r['ppl_vs_ref'] * 100:+.3g}% "
            f"| {r['top1'] * 100:.2f}% | {r['greedy_equal']}/{r['questions']} "
            f"| {r['logprob_abs_diff_mean']:.2g} |"
        )
    return lines


def differing(s: dict[str, Any]) -> list[str]:
    """Per path, the questions whose greedy answer parts from the reference's, as
    ``q<question>@<token>`` with the reference's top-2 log-prob gap at that token; then the
    text of each question named."""
    lines = []
    named: set[int] = set()
    for r in s["paths"]:
        diffs = r.get("differing")
        if not diffs:
            continue
        items = []
        for d in diffs:
            gap = "–" if d["ref_gap"] is None else f"{d['ref_gap']:.2g}"
            items.append(f"q{d['question']}@{d['at']} ({gap})")
            named.add(d["question"])
        lines.append(f"- `{r['variant']}` ({len(diffs)}/{r['questions']}): " + ", ".join(items))
    if named:
        texts = [q["text"] for q in s["questions"]]
        lines += ["", "; ".join(f'q{i} "{texts[i]}"' for i in sorted(named)) + "."]
    return lines


def markdown(s: dict[str, Any]) -> list[str]:
    """The report section, as lines."""
    ref = s["reference"]
    m = s["machine"]
    model = s["model"]
    source = f" (from {model['gguf_file']}, dequantized by gguf-py)" if model["gguf_file"] else ""
    quick = " (quick: smoke-test size)" if s["quick"] else ""
    quick += " (interrupted: the paths that finished)" if s.get("interrupted") else ""
    lines = [
        f"## Fidelity{quick}",
        "",
        f"Command: `{s['command'].strip()}` ({s['elapsed_s'] / 60:.1f} min). Machine: "
        f"{m['cores']} cores, {m['processor']} ({', '.join(m['simd'])}); torch {m['torch']}.",
        "",
        f"Reference: {ref['engine']}, the weights of {model['dir']}{source}. Perplexity on "
        f"{ref['text']}: {ref['windows']} windows of {ref['window']} tokens ({ref['positions']} "
        f"positions scored, teacher forced); top-1 agreement over the same positions; greedy: "
        f"{len(s['questions'])} chat questions, the first {ref['answer_tokens']} tokens equal "
        "to the reference's (up to its first EOS).",
        "",
        *table(s),
        "",
    ]
    rows = [r for r in s["paths"] if "skipped" not in r]
    gaps = [(r["variant"], r["top1_mismatch_ref_gap_max"]) for r in rows]
    shown = ", ".join(f"{n} {g:.3g}" for n, g in gaps if g is not None)
    if shown:
        lines += [
            f"Largest reference top-2 log-prob gap at a position whose top-1 differs: {shown}.",
            "",
        ]
    diff_lines = differing(s)
    if diff_lines:
        lines += ["Questions whose greedy answer differs from the reference's: q<question>@<first "
                  "differing token> (the reference's top-2 log-prob gap there; near 0: a "
                  "near-tie any other summation order may flip):", "", *diff_lines, ""]  # fmt: skip
    return lines
