"""A GGUF model whose tensors mix types loads each in its own type, with no float32 copy of a
quantized matrix; a file the kernels cannot take is refused before any process starts, naming
the tensor and its type."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_blocks import random_blocks, write_tiny_llama_gguf

from pipellm.config import EngineConfig
from pipellm.kernels.cpu_kernels import why_unavailable
from pipellm.loader.gguf_file import GGUFFile, open_gguf
from pipellm.loader.source import resolve_model
from pipellm.model.gguf_linear import GgufEmbedding, QuantizedLinear
from pipellm.worker.worker import StageWorker

T = GGMLQuantizationType
# A K-quant mix as llama.cpp's quantizer writes one, and every other type once.
MIXED_TYPES = {
    "blk.0.attn_q.weight": T.Q5_0,
    "blk.0.attn_k.weight": T.Q4_K,
    "blk.0.attn_v.weight": T.Q6_K,
    "blk.0.ffn_gate.weight": T.Q4_K,
    "blk.0.ffn_up.weight": T.Q5_K,
    "blk.0.ffn_down.weight": T.Q4_0,
    "blk.1.attn_q.weight": T.IQ4_NL,
    "blk.1.attn_k.weight": T.F16,
    "blk.1.attn_v.weight": T.BF16,
    "blk.1.attn_output.weight": T.Q3_K,
    "blk.1.ffn_up.weight": T.Q2_K,
    "blk.1.ffn_gate.weight": T.Q5_1,
    "blk.1.ffn_down.weight": T.IQ4_XS,
    "token_embd.weight": T.Q6_K,
}
needs_kernels = pytest.mark.skipif(
    why_unavailable() is not None, reason=f"CPU kernels unavailable: {why_unavailable()}"
)


def linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear) or "proj" in name or name == "lm_head"
    }


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_mixed_types_load_as_stored_and_compute_as_float32(tmp_path, tied):
    path = tmp_path / "mixed.gguf"
    write_tiny_llama_gguf(path, MIXED_TYPES, tied=tied)
    quantized = StageWorker(EngineConfig(model=str(path)), 0).model
    reference = StageWorker(EngineConfig(model=str(path), quantization="none"), 0).model
    assert isinstance(quantized.embed_tokens, GgufEmbedding)
    assert quantized.embed_tokens.kind == T.Q6_K
    kinds = {name: layer.kind for name, layer in linears(quantized).items()}
    assert kinds["layers.0.self_attn.qkv_proj"] == "Q5_0+Q4_K+Q6_K"
    assert kinds["layers.0.mlp.gate_up_proj"] == "Q4_K+Q5_K"
    assert kinds["layers.1.self_attn.qkv_proj"] == "IQ4_NL+F16+BF16"
    assert kinds["layers.1.mlp.gate_up_proj"] == "Q5_1+Q2_K"
    assert kinds["layers.1.mlp.down_proj"] == T.IQ4_XS
    assert kinds["lm_head"] == (T.Q6_K if tied else T.Q8_0)
    # No float32 matrix anywhere: every parameter left is a norm (or a meta placeholder).
    for name, parameter in quantized.named_parameters():
        assert parameter.dim() == 1 or parameter.is_meta, name
    ids = torch.tensor([0, 5, 95, 17])
    assert torch.equal(quantized.embed_tokens(ids), reference.embed_tokens(ids))
    reference_linears = linears(reference)
    x = torch.randn(3, 512)
    for name, layer in linears(quantized).items():
        rows = x[:, : layer.in_features]
        # The same weights as the float32 model's (q/k rows unpermuted alike), same results.
        torch.testing.assert_close(layer(rows), reference_linears[name](rows), rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("quantization", ["gguf", "gguf_int8"])
def test_a_tied_q8_0_table_is_held_once(tmp_path, quantization):
    path = tmp_path / "tied.gguf"
    values = write_tiny_llama_gguf(path, {}, default=T.Q8_0, tied=True)
    model = StageWorker(EngineConfig(model=str(path), quantization=quantization), 0).model
    embedding = model.embed_tokens
    assert embedding.table is None and embedding.head is model.lm_head
    ids = torch.tensor([[0, 15, 16], [95, 47, 3]])
    expected = torch.from_numpy(values["token_embd.weight"])[ids]
    assert torch.equal(embedding(ids), expected)
    with pytest.raises(RuntimeError, match="token id 96 is outside the table's 96 rows"):
        embedding(torch.tensor([96]))


def test_truncated_file_names_the_tensor(tmp_path):
    path = tmp_path / "cut.gguf"
    write_tiny_llama_gguf(path, {})
    os.truncate(path, path.stat().st_size - 1000)
    with pytest.raises(ValueError, match=r"tensor 'output_norm.weight' \(F32.*truncated"):
        EngineConfig(model=str(path))


@needs_kernels
def test_a_type_the_kernels_do_not_take_is_refused(tmp_path):
    path = tmp_path / "ternary.gguf"
    write_tiny_llama_gguf(path, {"blk.1.ffn_up.weight": T.TQ1_0})
    with pytest.raises(ValueError, match=r"'blk.1.ffn_up.weight'.* is TQ1_0.*quantization='none'"):
        EngineConfig(model=str(path))
    assert EngineConfig(model=str(path), quantization="none").quantization == "none"


def test_rows_that_are_not_whole_blocks_are_refused(tmp_path):
    path = tmp_path / "ragged.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = random_blocks(T.Q4_K, 4, 256, seed=0)
    # A header that claims 200-value rows for 144-byte Q4_K rows (one 256-value block each).
    writer.add_tensor_info(
        "blk.0.attn_q.weight", (4, 200), np.dtype(np.float32), blocks.nbytes, T.Q4_K
    )
    writer.tensors[-1]["blk.0.attn_q.weight"].tensor = blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' \(Q4_K.*rows of 200 values"):
        GGUFFile(path)


def test_an_unknown_tensor_type_id_is_refused(tmp_path):
    path = tmp_path / "unknown.gguf"
    write_tiny_llama_gguf(path, {})
    entry = next(t for t in GGUFFile(path).tensors if t.name == "output_norm.weight")
    # The type id sits right after the name, the dimension count and one uint64 dimension.
    raw = bytearray(path.read_bytes())
    name = struct.pack("<Q", len(entry.name)) + entry.name.encode() + struct.pack("<I", 1)
    type_at = raw.index(name) + len(name) + 8
    assert struct.unpack_from("<I", raw, type_at)[0] == T.F32
    struct.pack_into("<I", raw, type_at, 250)
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=r"'output_norm.weight' has GGML type id 250.*Q8_0"):
        EngineConfig(model=str(path))


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (lambda raw: b"GGML" + raw[4:], "is not a GGUF file"),
        (lambda raw: raw[:4] + struct.pack("<I", 1) + raw[8:], "GGUF version 1 is not supported"),
        (lambda raw: raw[:4] + struct.pack(">I", 3) + raw[8:], "big-endian"),
        (lambda raw: raw[:100], "header ends before its last field"),
        (lambda raw: raw[:10], "too short"),
    ],
)
def test_a_bad_header_is_refused_clearly(tmp_path, cut, match):
    path = tmp_path / "bad.gguf"
    write_tiny_llama_gguf(path, {})
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=str(path))


def _every_value_type(path) -> None:
    """A tiny GGUF whose metadata holds every GGUF value type, arrays of each, and nesting."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for kind, value in [
        ("uint8", 200),
        ("int8", -100),
        ("uint16", 60000),
        ("int16", -30000),
        ("uint32", 4_000_000_000),
        ("int32", -2_000_000_000),
        ("uint64", 2**63 + 5),
        ("int64", -(2**62)),
        ("float32", 0.1),
        ("float64", 1e-300),
        ("bool", True),
        ("string", "héllo ▁ 🦙"),
    ]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_array("test.floats", [0.5, -1.25, 3e-8])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.strings", ["", "a", "ü", "<0x0A>"])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.after", "read past every array")
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("model", ["every-type", None])
def test_the_header_reads_as_ggufs_own_reader_reads_it(model, tmp_path):
    """Every metadata value and tensor entry equals gguf.GGUFReader's (the reference parser):
    a file with each value type, and the built-in model's."""
    if model == "every-type":
        path = tmp_path / "types.gguf"
        _every_value_type(path)
    else:
        path = resolve_model(model).path
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [key for key in theirs.fields if not key.startswith("GGUF.")]
    for key in keys:
        if key == "test.nested":  # GGUFReader's contents() flattens nesting; read the parts
            assert ours.value(key) == [[1, 2], [3]]
            continue
        value, expected = ours.value(key), theirs.fields[key].contents()
        assert value == expected and type(value) is type(expected), key
    tokens = "test.strings" if model == "every-type" else "tokenizer.ggml.tokens"
    assert ours.array_length(tokens) == len(theirs.fields[tokens].data)
    with pytest.raises(ValueError, match="no metadata field 'general.nothing'"):
        ours.value("general.nothing")
    assert ours.value("general.nothing", 7) == 7
    assert [(t.name, t.tensor_type, t.shape, t.offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes)
        for t in theirs.tensors
    ]


def test_a_file_rewritten_in_place_is_read_again(tmp_path):
    path = tmp_path / "model.gguf"
    write_tiny_llama_gguf(path, {})
    first = open_gguf(path)
    assert open_gguf(path) is first
    write_tiny_llama_gguf(path, {"blk.0.attn_q.weight": T.Q4_K})
    os.utime(path, ns=(1, 1))  # a new modification time even on a coarse clock
    tensors = {t.name: t.tensor_type for t in open_gguf(path).tensors}
    assert tensors["blk.0.attn_q.weight"] == T.Q4_K


def test_tensor_parallelism_splits_k_quants_only_on_whole_blocks(tmp_path):
    path = tmp_path / "k.gguf"
    # ffn_down's 512 input columns split in two 256-value blocks; attn_output's 256 cannot.
    write_tiny_llama_gguf(path, {"blk.0.ffn_down.weight": T.Q4_K, "blk.1.ffn_down.weight": T.Q6_K})
    EngineConfig(model=str(path), tensor_parallel_size=2)
    write_tiny_llama_gguf(path.with_name("o.gguf"), {"blk.1.attn_output.weight": T.Q4_K})
    with pytest.raises(ValueError, match=r"o_proj.*\[0, 128\).*blocks of 256 values"):
        EngineConfig(model=str(path.with_name("o.gguf")), tensor_parallel_size=2)
