"""The benchmark's plots (matplotlib; ``pip install 'asyncllm[bench]'``)."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

from asyncllm.bench.options import base_engine
from asyncllm.bench.reporting.summary import _order


def make_plots(s: dict[str, Any], bench: Any, img: pathlib.Path) -> list[str]:
    """PNG plots of a summary (:data:`PLOTS`, those with data); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    labels = {e: v["label"] for e, v in s["engines"].items()}
    paths: list[str] = []
    for plot, name in PLOTS:
        fig = plot(s, plt, labels)
        if fig is not None:
            paths.append(_save(fig, img / name))
    return paths


COLORS = {"asyncllm": "C0", "vllm": "C1", "hf": "C2", "hf_cb": "C3", "llamacpp": "C6"}


def color(e: str) -> str:
    """An engine's line color (asyncllm's variants and other peers share one each)."""
    return COLORS.get(e, "C4" if base_engine(e) == "asyncllm" else "C5")


def _plot_sweep(s: dict[str, Any], plt: Any, labels: dict[str, str]) -> Any:
    """Throughput against concurrent requests. None: nothing to plot."""
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
        return fig

    return None


def _plot_w4(s: dict[str, Any], plt: Any, labels: dict[str, str]) -> Any:
    """TTFT and TPOT distributions under W4. None: nothing to plot."""
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
        return fig

    return None


def _plot_kv(s: dict[str, Any], plt: Any, labels: dict[str, str]) -> Any:
    """KV cache held against tokens in use (W1, W6), and against a static batch's. None:
    nothing to plot."""
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
        return fig

    return None


def _plot_breakdown(s: dict[str, Any], plt: Any, labels: dict[str, str]) -> Any:
    """The step time's parts at W1's peak batch. None: nothing to plot."""
    b = s.get("breakdown")
    if b:
        mean = b["mean_s"]
        parts = [
            ("scheduling", mean["schedule"] + mean["update"]),
            ("input prep", mean["prep"]),
            ("forward", mean["forward"]),
            ("sampling", mean["sample"]),
            ("event loop between steps", mean["post"]),
            ("trace bookkeeping", max(mean["other"], 0)),
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
        return fig
    return None


PLOTS = (
    (_plot_sweep, "throughput_vs_concurrency.png"),
    (_plot_w4, "w4_latency_cdf.png"),
    (_plot_kv, "kv_cache_waste.png"),
    (_plot_breakdown, "w1_step_breakdown.png"),
)


def _save(fig: Any, path: pathlib.Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return str(path)
