"""A weightless model folder for simulations: every token decodes to a word of its own, so
every streamed token carries text and virtual-time figures can be computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import models, pre_tokenizers

WORD_VOCAB_SIZE = 64


def make_word_model(directory: Path, num_layers: int = 4) -> Path:
    """config.json (a tiny Llama) and a word-level tokenizer.json without special tokens."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(WORD_VOCAB_SIZE)}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": WORD_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def write_profile(path: Path, profile: dict) -> str:
    path.write_text(json.dumps(profile))
    return str(path)
