"""Tiny Hugging Face checkpoints built on the spot, so tests need no download."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2  # as SmolLM2: <|im_start|> and <|im_end|>

# ChatML, as SmolLM2 and Qwen2 write it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Pipeline parallelism keeps every stage busy with its own micro-batch.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; prices $3.50 and 42%.",
    "Le café est très bon. Über Straße. 日本語のテキスト. Emoji 😀👍.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n",
]

_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "tied": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
    "gemma3": transformers.Gemma3TextConfig,
}
# A sliding window far shorter than the tests' prompts (tests/test_model_families.py).
TINY_SLIDING_WINDOW = 8
# Per family, what its tiny checkpoint sets beyond the shared shape: Gemma 3's head_dim is
# not hidden / heads and its attention scale not head_dim's, as in the real models; its five
# local layers then one global one (6 layers) use a window of TINY_SLIDING_WINDOW. Mistral's
# window applies to every layer (its config has no layer_types), so its tiny one is short too.
_FAMILY_KWARGS = {
    "gemma3": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=TINY_SLIDING_WINDOW),
    "qwen3": dict(head_dim=16),
    "mistral": dict(sliding_window=TINY_SLIDING_WINDOW),
}


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run tiny-model work in this process on one thread. Its matrices are a few dozen wide, too
    small to split; split over two threads, each op waits for the slower one, which, when
    another process holds a core, is descheduled: then it runs ten times slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_tiny_tokenizer(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A byte-level BPE (GPT-2 style, like SmolLM2's) trained on a few sentences, with
    SPECIAL_TOKENS at ids 0-2. Deterministic; every byte is in its alphabet."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT, trainer)
    return tokenizer


def make_tiny_checkpoint(
    directory: Path,
    arch: str = "llama",
    num_layers: int | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    num_kv_heads: int = 2,
    num_heads: int = 4,
) -> Path:
    """Write a tiny seeded Hugging Face checkpoint into `directory` and return it.

    arch: "llama", "qwen2" (q/k/v biases), "qwen3" (q/k norms), "mistral" (a sliding window
    on every layer), "tied" (llama
    with lm_head tied to the embedding) or "gemma3" (see _FAMILY_KWARGS; tied, as Gemma is).
    Shape: 4 layers (Gemma 3: 6), hidden 64, 4 heads of 16 with 2 KV heads (GQA), intermediate
    128, max_position_embeddings 512, vocabulary = the tiny tokenizer's (300 tokens). Every weight,
    biases and norms included, is random (std 0.1) so that logits are decisive and a wrongly
    loaded tensor shows. max_shard_size (e.g. "20KB") splits the weights into several
    .safetensors files with model.safetensors.index.json; num_kv_heads=1 makes KV heads fewer
    than two tensor-parallel ranks; num_heads=6 with num_kv_heads=3 (heads of 16 still, so
    hidden 96) gives two ranks uneven query groups, as SmolLM2's 9 and 3 do
    (model/tp_plan.py). The folder also holds tokenizer.json
    and tokenizer_config.json (ChatML template, bos <|im_start|>, eos <|im_end|>).
    """
    directory = Path(directory)
    tokenizer = make_tiny_tokenizer()
    config = _CONFIG_CLASSES[arch](
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=16 * num_heads,
        intermediate_size=128,
        num_hidden_layers=num_layers or (6 if arch == "gemma3" else 4),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=arch in ("tied", "gemma3"),
        **_FAMILY_KWARGS.get(arch, {}),
    )
    torch.manual_seed(seed)
    with one_torch_thread(), torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_config(config)
        for name, param in model.named_parameters():
            if "norm" in name and arch == "gemma3":  # Gemma's norms scale by (1 + w)
                param.normal_(0, 0.1)
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(directory, safe_serialization=True, **kwargs)
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


# Hugging Face names -> llama.cpp's, as convert_hf_to_gguf.py writes them.
_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _gguf_tensor_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{_GGUF_LAYER[part]}.{suffix}"
    return f"{_GGUF_GLOBAL[base]}.{suffix}"


def _rope_permuted(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row order for the llama architecture: each head's
    rotate-half rows (first half, second half) as interleaved pairs."""
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def write_tiny_gguf(
    folder: Path,
    path: Path,
    architecture: str | None = None,
    tokenizer_model: str = "gpt2",
    metadata: dict[str, str] | None = None,
) -> Path:
    """The tiny checkpoint in `folder` as a float32 GGUF file, laid out as llama.cpp's converter
    writes Llama (q/k rows permuted; Llama 3 RoPE scaling as a rope_freqs tensor), Qwen2 and
    Qwen3; its byte-level BPE tokenizer with the gpt-2 pre-tokenizer. `architecture`,
    `tokenizer_model` and `metadata` (string fields added) write what pipellm refuses."""
    from safetensors.numpy import load_file

    from pipellm.loader.source import load_model_config, resolve_model
    from pipellm.model.rope import inverse_frequencies

    config = load_model_config(resolve_model(str(folder)))
    arch = architecture or _GGUF_ARCHITECTURES[config.architecture]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    for name, weight in tensors.items():
        if arch == "llama" and ".q_proj." in name:
            weight = _rope_permuted(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = _rope_permuted(weight, config.num_key_value_heads)
        writer.add_tensor(_gguf_tensor_name(name), np.ascontiguousarray(weight, np.float32))
    if config.rope_scaling is not None:  # Llama 3: each pair's divisor of its frequency
        args = (config.head_dim, config.rope_theta)
        plain, _ = inverse_frequencies(*args, None, config.max_position_embeddings)
        scaled, _ = inverse_frequencies(*args, config.rope_scaling, config.max_position_embeddings)
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
