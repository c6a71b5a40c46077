"""llama.cpp as a benchmark peer (:mod:`asyncllm.bench.engine_process` runs it in the
llama.cpp venv): llama-cpp-python's low-level API, batched greedy decoding, and its
prompt-lookup decoding on one stream.

Standard library only at the top (and llama_cpp, numpy when a worker starts): the llama.cpp
venv imports it beside ``engine_process.py`` by path, without asyncllm installed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

try:
    from asyncllm.bench.engine_protocol import Timeline, Unsupported, rss_mb
except ImportError:  # by path in the llama.cpp venv: the file beside this one
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engine_protocol import Timeline, Unsupported, rss_mb  # type: ignore[no-redef]


def pad256(n: int) -> int:
    """``n`` rounded up to a multiple of 256 (llama.cpp pads each sequence's context so)."""
    return -(-n // 256) * 256


class LlamaCppWorker:
    """llama.cpp through llama-cpp-python's low-level API (its C functions), on one GGUF file
    at its own quantization (the default model's Q4_1), ``n_threads = n_threads_batch =
    --threads``. Runs under the llama.cpp venv's interpreter.

    A run's requests are fed as token ids (no tokenizer on the timed path) into
    ``llama_batch``es of one context with ``n_seq_max`` = the number of requests, each
    sequence with its own KV stream (``kv_unified`` off, so no sequence attends over the
    others' cells): first all prompts, in chunks of ``n_batch`` tokens, then one decode step
    for every unfinished sequence at a time, greedy (argmax of the logits, first index on a
    tie, as torch's argmax), EOS ignored. This is llama.cpp's own batched decoding
    (llama.cpp's examples/batched and its server's slots work the same way). Online arrivals
    (W4) are not run. Sources: llama.cpp's include/llama.h (``llama_decode``,
    ``llama_batch``, ``llama_context_params``).

    With ``--draft-tokens K`` it runs one stream (W3, W7) with llama-cpp-python's prompt-lookup
    decoding (``Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K))``): each step
    asks its ``LlamaPromptLookupDecoding`` for up to K tokens after the last n-gram (2 or 1
    tokens) of the prompt and output, decodes the pending token and those in one
    ``llama_decode``, keeps the proposals that the greedy tokens confirm plus the first
    greedy token after them, and drops the KV cells of the rest (``llama_memory_seq_rm``), as
    ``Llama.generate`` does with a draft model.
    """

    name = "llamacpp"
    N_BATCH = 2048  # llama.cpp's default logical batch (tokens per llama_decode call)

    def __init__(self, args: argparse.Namespace) -> None:
        import llama_cpp as ll
        import numpy as np

        self.ll, self.np = ll, np
        self.threads = args.threads
        self.path = args.model
        ll.llama_backend_init()

        def log(level: int, text: bytes, _: Any) -> None:  # warnings and errors only
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode(errors="replace"))

        self._log = ll.llama_log_callback(log)  # kept alive: llama.cpp holds the pointer
        ll.llama_log_set(self._log, None)
        t = time.perf_counter()
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        # Extra buffer types repack weights for AMX or AVX kernels. On the benchmark's VM
        # (Xeon with AMX, Firecracker) the AMX kernels die at their first tileloadd (SIGILL)
        # although the kernel grants AMX: off unless asked for.
        mp.use_extra_bufts = bool(args.extra_bufts)
        self.extra_bufts = bool(args.extra_bufts)
        self.model = ll.llama_model_load_from_file(args.model.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {args.model}")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.load_s = time.perf_counter() - t
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, buf, len(buf))
        self.desc = buf.value.decode(errors="replace")
        self.ctx: Any = None
        self.batch: Any = None
        self.ctx_key: tuple[int, int] | None = None
        self.tokenizer = self.check_tokenizer(args.prompts) if args.prompts else None
        self.draft: Any = None
        if args.draft_tokens:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.draft = LlamaPromptLookupDecoding(num_pred_tokens=args.draft_tokens)

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's ids for ``text``, special tokens parsed, none added (as the workloads'
        chat-templated texts are tokenized by transformers)."""
        data = text.encode()
        out = (self.ll.llama_token * (len(data) + 8))()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), out, len(out), False, True)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(ctypes.cast(out, ctypes.POINTER(ctypes.c_int32))[:n])

    def check_tokenizer(self, prompts: str) -> dict[str, str]:
        """Per workload of prompts.json, how many of its texts llama.cpp tokenizes to the ids
        transformers gave (``"64/64"``). The runs feed those ids either way."""
        with open(prompts) as f:
            data = json.load(f)
        out = {}
        for key in ("W1", "W2", "W3", "W7"):
            if key in data and "texts" in data[key]:
                pairs = zip(data[key]["texts"], data[key]["ids"], strict=True)
                same = sum(1 for text, ids in pairs if self.tokenize(text) == ids)
                out[key] = f"{same}/{len(data[key]['ids'])}"
        return out

    def info(self) -> dict[str, Any]:
        import llama_cpp

        return {
            "engine": self.name,
            "version": llama_cpp.__version__,
            "threads": self.threads,
            "load_s": self.load_s,
            "rss_mb": rss_mb(),
            "model": self.desc,
            "precision": self.desc.rsplit(" ", 1)[-1] + " (GGUF)",
            "weight_bytes": int(self.ll.llama_model_size(self.model)),
            "tokenizer_ids_match": self.tokenizer,
        }

    def context(self, n_seq: int, per_seq: int) -> None:
        """A context for ``n_seq`` sequences of up to ``per_seq`` tokens each (the last one is
        kept while its size fits; its KV cache is cleared); warmed by one decode."""
        ll = self.ll
        if self.ctx_key == (n_seq, per_seq):
            ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
            return
        self.free_context()
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_seq * per_seq
        cp.n_batch = self.N_BATCH
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = False
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {cp.n_ctx} tokens")
        self.batch = ll.llama_batch_init(max(self.N_BATCH, n_seq), 0, 1)
        self.ctx_key = (n_seq, per_seq)
        self.settings = {
            "dtype": self.desc.rsplit(" ", 1)[-1] + " weights (GGUF)",
            "batching": f"low-level llama_batch, {n_seq} sequence(s), per-sequence KV",
            "n_ctx": cp.n_ctx,
            "n_batch": cp.n_batch,
            "n_ubatch": cp.n_ubatch,
            "extra_bufts": self.extra_bufts,
            "threads": self.threads,
        }
        self.decode([(0, 0, 0, True)])  # first use allocates; keep it off the clock
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)

    def decode(self, items: Sequence[tuple[int, int, int, bool]]) -> Any:
        """One ``llama_decode`` of ``(sequence, position, token, wants logits)`` items; returns
        the greedy next token of each item that wants logits, in order (numpy array)."""
        ll, b = self.ll, self.batch
        for k, (seq, pos, tok, want) in enumerate(items):
            b.token[k] = tok
            b.pos[k] = pos
            b.n_seq_id[k] = 1
            b.seq_id[k][0] = seq
            b.logits[k] = int(want)
        b.n_tokens = len(items)
        rc = ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for it in items if it[3])
        if not n_out:
            return self.np.empty(0, dtype=self.np.int64)
        # The rows of the items that asked for logits, in batch order (llama.h).
        logits = self.np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), (n_out, self.n_vocab))
        return logits.argmax(axis=1)

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        reqs = spec["requests"]
        if any(r[2] > 0 for r in reqs):
            raise Unsupported("offline batched decoding only here (no online arrivals)")
        if self.draft is not None:
            if len(reqs) != 1:
                raise Unsupported("prompt-lookup decoding runs one stream here (W3, W7)")
            return self.run_lookup(spec)
        n = len(reqs)
        self.context(n, pad256(max(len(ids) + m for ids, m, _ in reqs)))
        tl = Timeline(n)
        nxt = [0] * n
        start = time.perf_counter()
        tl.submit = [start] * n
        # Prefill: every prompt, in chunks of n_batch tokens; logits at each prompt's end.
        items = [
            (i, pos, tok, pos == len(ids) - 1)
            for i, (ids, _, _) in enumerate(reqs)
            for pos, tok in enumerate(ids)
        ]
        for c in range(0, len(items), self.N_BATCH):
            chunk = items[c : c + self.N_BATCH]
            toks = self.decode(chunk).tolist()
            now = time.perf_counter()
            ends = [it[0] for it in chunk if it[3]]
            for i, tok in zip(ends, toks, strict=True):
                nxt[i] = tok
                tl.got(i, [tok], now)
        pos = [len(r[0]) for r in reqs]
        left = [r[1] - 1 for r in reqs]
        while True:
            active = [i for i in range(n) if left[i] > 0]
            if not active:
                break
            toks = self.decode([(i, pos[i], nxt[i], True) for i in active]).tolist()
            now = time.perf_counter()
            for i, tok in zip(active, toks, strict=True):
                nxt[i] = tok
                pos[i] += 1
                left[i] -= 1
                tl.got(i, [tok], now)
        res = tl.result(start, spec.get("outputs", False))
        res["settings"] = self.settings
        return res

    def run_lookup(self, spec: dict[str, Any]) -> dict[str, Any]:
        """One request, greedy, with prompt-lookup proposals verified a step at a time."""
        ll, np = self.ll, self.np
        ((ids, max_tokens, _),) = spec["requests"]
        self.context(1, pad256(len(ids) + max_tokens))
        mem = ll.llama_get_memory(self.ctx)
        tl = Timeline(1)
        start = time.perf_counter()
        tl.submit = [start]
        items = [(0, pos, tok, pos == len(ids) - 1) for pos, tok in enumerate(ids)]
        for c in range(0, len(items), self.N_BATCH):
            out = self.decode(items[c : c + self.N_BATCH]).tolist()
        nxt, context = out[-1], [*ids]
        tl.got(0, [nxt], time.perf_counter())
        pos, left = len(ids), max_tokens - 1
        proposed = accepted = steps = 0
        while left > 0:
            # At most left - 1 proposals: the step yields one token more than it accepts.
            draft = self.draft(np.array([*context, nxt], dtype=np.intc)).tolist()[: left - 1]
            batch = [nxt, *draft]
            greedy = self.decode([(0, pos + j, t, True) for j, t in enumerate(batch)]).tolist()
            j = 0
            while j < len(draft) and draft[j] == greedy[j]:
                j += 1
            new = greedy[: j + 1]
            ll.llama_memory_seq_rm(mem, 0, pos + j + 1, -1)  # the rejected proposals' cells
            tl.got(0, new, time.perf_counter())
            context += batch[: j + 1]
            nxt, pos, left = new[-1], pos + j + 1, left - len(new)
            proposed, accepted, steps = proposed + len(draft), accepted + j, steps + 1
        res = tl.result(start, spec.get("outputs", False))
        res["settings"] = {
            **self.settings,
            "speculation": f"LlamaPromptLookupDecoding(max_ngram_size={self.draft.max_ngram_size}"
            f", num_pred_tokens={self.draft.num_pred_tokens})",
        }
        res["stats"] = {
            "spec_num_draft_tokens": proposed,
            "spec_num_accepted_tokens": accepted,
            "spec_num_steps": steps,
        }
        return res

    def free_context(self) -> None:
        if self.ctx is not None:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
        self.ctx = self.batch = self.ctx_key = None

    def close(self) -> None:
        self.free_context()
        self.ll.llama_model_free(self.model)
