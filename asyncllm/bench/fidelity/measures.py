"""The fidelity harness (``python -m asyncllm bench --fidelity``): how far each asyncllm
precision path, and llama.cpp on the same GGUF file, is from the model's exact weights.

Reference: transformers' own model in float32 with eager attention, built from the model's
weights as its file defines them (a GGUF file dequantized to float32 by gguf-py through
transformers' ``from_pretrained(..., gguf_file=...)``: the converted directory asyncllm's
loader keeps under its cache is exactly that; :mod:`asyncllm.bench.fidelity.reference`).

Measured for every path of :data:`PATHS` (one engine process each) and the llama.cpp peer:

* perplexity of ``tests/data/public_domain.txt`` cut into fixed windows of
  :attr:`Size.window` tokens (the text tokenized once, without special tokens; each window
  scored from its second token, teacher forced, from ``SamplingParams.prompt_logprobs``),
  and its ratio to the reference's;
* top-1 agreement: the share of those positions whose most likely next token is the
  reference's;
* greedy agreement: the share of :data:`QUESTIONS_FILE`'s questions (chat template applied,
  as ``python -m asyncllm generate`` does) whose first :attr:`Size.answer_tokens` greedy
  tokens equal the reference's (compared up to and including the reference's first EOS),
  and for each one that differs, the token where it parts and the reference's top-2
  log-prob gap there (a gap near 0 is a near-tie that any other summation order may flip).

Outputs in ``--out``: ``fidelity.jsonl`` (one line per path, in the shape of the other
workloads' ``results.jsonl`` lines, workload ``"fidelity"``), ``fidelity.json`` (the summary),
``fidelity.md`` (the report section) and ``fidelity_reference.json`` (the reference's
figures, reused by later runs on the same model). The run is
:func:`asyncllm.bench.fidelity.run.run`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[3]
#: The text perplexity is measured on (2,009 tokens with the default model's tokenizer).
TEXT_FILE = REPO / "tests" / "data" / "public_domain.txt"
#: The chat questions greedy agreement is measured on (shipped with the package).
QUESTIONS_FILE = pathlib.Path(__file__).with_name("questions.json")


@dataclasses.dataclass(frozen=True)
class FidelityPath:
    """One asyncllm path: an engine configuration and environment switches.

    Attributes:
        name: a short id (``--fidelity-paths``, file names, the JSON).
        label: what it is, for the report.
        config: ``EngineConfig`` fields set over the engine's defaults.
        env: environment variables set in its engine process (a kernel's off switch).
    """

    name: str
    label: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)


#: Every asyncllm path the harness measures, in report order. The one place that names the
#: kernels' off switches (the attention's is an engine setting, the others variables).
PATHS: tuple[FidelityPath, ...] = (
    FidelityPath("default", "engine defaults (dtype, quantization and compile \"auto\")"),
    FidelityPath("eager", "defaults, compile off", {"compile": False}),
    FidelityPath("no-native-forward", "defaults, C++ forward off (the modeling code)",
                 env={"ASYNCLLM_NATIVE_FORWARD": "0"}),
    FidelityPath("no-attention-kernel", "defaults, C++ paged attention kernel off",
                 {"attention_backend": "torch"}),
    FidelityPath("no-int4-kernel", "defaults, C++ int4 dequant/GEMV kernel off",
                 env={"ASYNCLLM_INT4_DEQUANT_KERNEL": "0"}),
    FidelityPath("no-q8-kernel", "defaults, C++ Q8_0 head kernel off",
                 env={"ASYNCLLM_Q8_KERNEL": "0"}),
    FidelityPath("no-packed-linear", "defaults, oneDNN packed linears off",
                 env={"ASYNCLLM_CPU_PACKED_LINEAR": "0"}),
    FidelityPath("float32", "float32, no quantization", {"dtype": "float32", "quantization": None}),
    FidelityPath("bfloat16", "bfloat16, no quantization",
                 {"dtype": "bfloat16", "quantization": None}),
    FidelityPath("int8", "int8 weights (per channel)", {"quantization": "int8"}),
    FidelityPath("int4", "int4 weights (group 32)", {"quantization": "int4"}),
    FidelityPath("gguf", "the GGUF file's own blocks", {"quantization": "gguf"}),
    FidelityPath("gguf-bfloat16", "the GGUF file's own blocks, bfloat16",
                 {"dtype": "bfloat16", "quantization": "gguf"}),
    FidelityPath("gguf-float32", "the GGUF file's own blocks, float32",
                 {"dtype": "float32", "quantization": "gguf"}),
    FidelityPath("kv-int8", "defaults, int8 KV cache", {"kv_cache_dtype": "int8"}),
    FidelityPath("float32-kv-int8", "float32, no quantization, int8 KV cache",
                 {"dtype": "float32", "quantization": None, "kv_cache_dtype": "int8"}),
    FidelityPath("bfloat16-kv-int8", "bfloat16, no quantization, int8 KV cache",
                 {"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "int8"}),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Size:
    """How much text and how many questions a run measures.

    Attributes:
        window: tokens per perplexity window (lowered to fit the model's positions).
        windows: the most windows (None: as many whole windows as the text holds).
        questions: the most questions (None: all of :data:`QUESTIONS_FILE`).
        answer_tokens: greedy tokens compared per question.
    """

    window: int = 256
    windows: int | None = None
    questions: int | None = None
    answer_tokens: int = 32


FULL = Size()
QUICK = Size(windows=2, questions=10)


def select_paths(text: str | None) -> list[FidelityPath]:
    """``--fidelity-paths``: a comma list of :data:`PATHS` names (None or "all": all).

    Raises:
        SystemExit: an unknown name, or none named.
    """
    if text is None or text.strip().lower() == "all":
        return list(PATHS)
    by_name = {p.name: p for p in PATHS}
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in by_name]
    if bad:
        raise SystemExit(f"--fidelity-paths: unknown {bad}; choose from {', '.join(by_name)}")
    if not names and text.strip().lower() != "none":
        raise SystemExit("--fidelity-paths names no path")
    return [by_name[n] for n in dict.fromkeys(names)]


def load_questions(path: str | pathlib.Path | None = None) -> list[str]:
    """The questions of ``path`` (default: :data:`QUESTIONS_FILE`), in order."""
    data = json.loads(pathlib.Path(path or QUESTIONS_FILE).read_text())
    return [str(q) for q in data["questions"]]


def text_windows(ids: Sequence[int], window: int, most: int | None = None) -> list[list[int]]:
    """``ids`` cut into consecutive windows of ``window`` tokens (the tail that does not fill
    one is dropped), at most ``most`` of them."""
    n = len(ids) // window
    if most is not None:
        n = min(n, most)
    return [list(ids[i * window : (i + 1) * window]) for i in range(n)]


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """The prompt ids of ``question`` as one user message, the chat template applied with
    ``add_generation_prompt=True`` (as ``python -m asyncllm generate`` builds it)."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(question))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------- metrics


def perplexity(logprobs: Sequence[Sequence[float]]) -> float:
    """exp of the mean negative log-probability over every position of every window."""
    flat = [x for w in logprobs for x in w]
    if not flat:
        raise ValueError("no scored positions")
    return math.exp(-math.fsum(flat) / len(flat))


def top1_agreement(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(positions whose top-1 token equals the reference's, positions)`` over windows.

    Raises:
        ValueError: the windows or their lengths differ.
    """
    same = total = 0
    for r, g in zip(ref, got, strict=True):
        for a, b in zip(r, g, strict=True):
            same += a == b
            total += 1
    return same, total


def reference_span(ref: Sequence[int], eos: Sequence[int], n: int) -> int:
    """How many of the reference's first ``n`` tokens count: up to and including its first
    EOS token, else ``n`` (or all it has)."""
    for j, t in enumerate(ref[:n]):
        if t in eos:
            return j + 1
    return min(n, len(ref))


def first_divergence(
    ref: Sequence[int], got: Sequence[int], eos: Sequence[int], n: int
) -> int | None:
    """The first index where ``got`` parts from the reference's answer (its first ``n``
    tokens, up to and including its first EOS), or None when ``got`` starts with it."""
    for j in range(reference_span(ref, eos, n)):
        if j >= len(got) or got[j] != ref[j]:
            return j
    return None


def relative(value: float, ref: float) -> float:
    """``value / ref - 1`` (0.01 is 1% above the reference)."""
    return value / ref - 1


def score(ref: dict[str, Any], got: dict[str, Any], eos: Sequence[int], n: int) -> dict[str, Any]:
    """A path's figures against the reference.

    Args:
        ref: the reference: ``windows`` (each ``logprobs``, ``top``, ``gap``: per scored
            position, the actual token's log-prob, the top-1 token and the top-2 gap) and
            ``answers`` (each ``ids`` and ``gaps``: the greedy tokens and the gap at each).
        got: the path's ``windows`` (each ``logprobs`` and ``top``) and ``answers`` (token
            id lists), in the reference's order.
        eos: the model's EOS ids (an answer is compared up to its first).
        n: greedy tokens compared per answer.
    """
    ref_w, got_w = ref["windows"], got["windows"]
    same, total = top1_agreement([w["top"] for w in ref_w], [w["top"] for w in got_w])
    mismatch_gaps = [
        gap
        for r, g in zip(ref_w, got_w, strict=True)
        for a, b, gap in zip(r["top"], g["top"], r["gap"], strict=True)
        if a != b
    ]
    diffs = [
        abs(a - b)
        for r, g in zip(ref_w, got_w, strict=True)
        for a, b in zip(r["logprobs"], g["logprobs"], strict=True)
    ]
    ppl = perplexity([w["logprobs"] for w in got_w])
    ref_ppl = perplexity([w["logprobs"] for w in ref_w])
    differing = []
    for i, (r, g) in enumerate(zip(ref["answers"], got["answers"], strict=True)):
        j = first_divergence(r["ids"], g, eos, n)
        if j is not None:
            gap = r["gaps"][j] if j < len(r["gaps"]) else None
            differing.append({"question": i, "at": j, "ref_gap": gap, "ids": list(g[:n])})
    questions = len(ref["answers"])
    return {
        "ppl": ppl,
        "ref_ppl": ref_ppl,
        "ppl_vs_ref": relative(ppl, ref_ppl),
        "top1": same / total,
        "top1_same": same,
        "positions": total,
        "top1_mismatch_ref_gap_max": max(mismatch_gaps, default=None),
        "logprob_abs_diff_mean": math.fsum(diffs) / len(diffs),
        "logprob_abs_diff_max": max(diffs),
        "greedy_equal": questions - len(differing),
        "questions": questions,
        "differing": differing,
    }
