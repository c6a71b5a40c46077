"""A tiny random-weight Llama for tests, examples and the server soak (no download).

2 layers, hidden size 64, 4 query heads over 2 KV heads (GQA), 256 positions, with the
default model's tokenizer (SmolLM2's, 49152 tokens) so text prompts work. Random weights
make it fast and make any output possible, which is what scheduling, streaming and
constrained-decoding tests need; it says nothing about quality.
"""

from __future__ import annotations

import pathlib
from typing import Any

#: The tiny model's ``LlamaConfig`` fields (also used for a Qwen2 variant in the tests).
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def save_tiny_llama(
    path: pathlib.Path, tokenizer_dir: pathlib.Path, seed: int = 0, max_positions: int = 256
) -> pathlib.Path:
    """Build the tiny Llama with ``torch.manual_seed(seed)`` and save it, with the tokenizer
    of ``tokenizer_dir`` (a Hugging Face directory), as a Hugging Face directory at ``path``.

    Args:
        max_positions: its ``max_position_embeddings`` (the longest sequence, tokens): 256
            by default; 512 holds an agent turn with tools in the prompt and a
            grammar-constrained call (the tool-calling example's CI run).
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_CONFIG, "max_position_embeddings": max_positions})
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path
