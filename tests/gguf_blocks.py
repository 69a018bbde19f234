"""Random GGUF blocks of every type the kernels take, written with numpy in the file's layout:
random bytes for the quants and sub-block scales, and finite float16 super-scales where the
layout keeps them (so every value is a real number, as in a file)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
# Byte offsets of each block's float16 scales (d, and dmin or m) in the GGUF layout.
_FLOAT16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}
QUANTIZED_TYPES = list(_FLOAT16_FIELDS)
# A type the kernels do not take, to test that it is refused: its scale is its last 2 bytes.
_FLOAT16_FIELDS_ELSEWHERE = {T.TQ1_0: (52,)}
FLOAT_TYPES = [T.F16, T.BF16]


def random_blocks(kind: GGMLQuantizationType, rows: int, columns: int, seed: int) -> np.ndarray:
    """uint8 [rows, columns / block values * block bytes]: a random matrix in `kind`."""
    rng = np.random.default_rng(seed)
    if kind == T.F16:
        return rng.normal(0, 0.05, (rows, columns)).astype(np.float16).view(np.uint8)
    if kind == T.BF16:
        values = rng.normal(0, 0.05, (rows, columns)).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, columns // block_values, block_bytes), dtype=np.uint8)
    for offset in _FLOAT16_FIELDS.get(kind) or _FLOAT16_FIELDS_ELSEWHERE[kind]:
        scales = rng.uniform(0.0005, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


# A tiny llama-architecture model's matrices: llama.cpp tensor name -> (rows, columns).
def tiny_llama_shapes(hidden: int, ffn: int, vocab: int, heads: int, kv_heads: int, layers: int):
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    return shapes


def write_tiny_llama_gguf(
    path,
    types: dict[str, GGMLQuantizationType],
    default: GGMLQuantizationType = T.Q8_0,
    hidden: int = 256,
    ffn: int = 512,
    vocab: int = 96,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    tied: bool = True,
) -> dict[str, np.ndarray]:
    """Writes a tiny llama GGUF whose matrices are random blocks, each in types.get(name,
    default) (F32 norms); returns each matrix's float32 values as `gguf` dequantizes them."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_eos_token_id(1)
    shapes = tiny_llama_shapes(hidden, ffn, vocab, heads, kv_heads, layers)
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    values = {}
    for index, (name, (rows, columns)) in enumerate(shapes.items()):
        kind = types.get(name, default)
        blocks = random_blocks(kind, rows, columns, seed=index)
        values[name] = gguf.quants.dequantize(blocks, kind).reshape(rows, columns)
        writer.add_tensor(name, blocks, raw_dtype=kind)
    norms = [f"blk.{i}.{part}.weight" for i in range(layers) for part in ("attn_norm", "ffn_norm")]
    for name in [*norms, "output_norm.weight"]:
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values
