"""How many structured outputs a strict JSON parser refuses (issue: agents and shared bots).

The tiny random-weight Llama (``asyncllm.bench.tiny_model``, SmolLM2's tokenizer) samples
``--samples`` documents per case at temperature 1.5, each under ``structured_outputs.json``;
every output that ends "stop" must parse with Python's strict ``json.loads`` (no raw control
character inside a string, RFC 8259) and validate against its schema (``jsonschema``). A
random model knows nothing of JSON, so only the grammar makes its outputs valid. Cases:

* ``length``: strings bounded by ``minLength``/``maxLength`` only (xgrammar 0.2.9's rule for
  them let raw control characters in: mlc-ai/xgrammar#800);
* ``stop_ids``: an object with free strings, the request's ``stop_token_ids`` holding ~2,000
  ordinary word tokens the grammar allows inside a string (they ended requests with "stop"
  and half a document).

Run::

    PYTHONPATH=. python benchmarks/structured_validity.py --samples 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile
import time

import jsonschema

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.bench.tiny_model import save_tiny_llama
from asyncllm.models.loader import resolve_model_dir

LENGTH = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"type": "string", "minLength": 2, "maxLength": 4},
        "c": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
FREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def _word_tokens(engine: AsyncEngine, schema: dict) -> list[int]:
    """Ids of the vocabulary's first 5,000 tokens that are words of 3+ letters the
    schema's keys do not need."""
    vocab = engine.tokenizer.convert_ids_to_tokens(list(range(5000)))
    keys = json.dumps(schema)
    return [
        i for i, t in enumerate(vocab)
        if len(w := t.lstrip("Ġ")) >= 3 and w.isalpha() and w not in keys
    ]  # fmt: skip


async def _case(engine: AsyncEngine, schema: dict, samples: int, stops: list[int]) -> dict:
    async def one(seed: int) -> tuple[str, str]:
        p = SamplingParams(
            max_tokens=80, seed=seed, temperature=1.5, stop_token_ids=stops or None,
            structured_outputs={"json": schema, "disable_any_whitespace": True},
        )  # fmt: skip
        out = await engine.generate("Answer:", p)
        return out.text, str(out.finish_reason)

    results = await asyncio.gather(*(one(s) for s in range(samples)))
    invalid = 0
    for text, reason in results:
        if reason != "stop":
            continue
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    stopped = sum(r == "stop" for _, r in results)
    return {"samples": samples, "stopped": stopped, "invalid": invalid}


async def main(samples: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tiny = save_tiny_llama(pathlib.Path(tmp), resolve_model_dir("default"))
        async with AsyncEngine.from_pretrained(str(tiny), max_num_seqs=64, compile=False) as engine:
            for name, schema, stops in (
                ("length", LENGTH, []),
                ("stop_ids", FREE, _word_tokens(engine, FREE)),
            ):
                t = time.perf_counter()
                row = await _case(engine, schema, samples, stops)
                row["s"] = round(time.perf_counter() - t, 1)
                print(json.dumps({"case": name, **row}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1000)
    asyncio.run(main(ap.parse_args().samples))
