"""Stream one pipeline stage's weights, under Hugging Face names, from safetensors or GGUF."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Container, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from pipellm.loader.gguf_file import TensorEntry
from pipellm.loader.gguf_tensors import map_tensors, read_tensor_index
from pipellm.loader.source import ModelSource
from pipellm.model.gguf_linear import GGUF_KERNEL_TYPES, QuantizedWeight
from pipellm.model.model_config import ModelConfig
from pipellm.model.stage_spec import StageSpec
from pipellm.model.tp_plan import (
    TensorParallelError,
    TensorParallelPlan,
    WeightShard,
    check_row_split,
)

# A tensor-parallel rank's part of a checkpoint tensor, by name (None: all of it).
ShardOf = Callable[[str], WeightShard | None]


def _whole(name: str) -> None:
    return None


_LAYER_WEIGHTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)
# Qwen2 has q/k/v biases; Llama with attention_bias=True has o_proj's too.
_BIASED_PROJECTIONS = _LAYER_WEIGHTS[:4]
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")

# llama.cpp tensor names (the part between "blk.N." and ".weight") -> Hugging Face names.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's four norms a layer: llama.cpp's ffn_norm is then the MLP's input norm, which
# Hugging Face calls pre_feedforward_layernorm (see model/llama.py's DecoderLayer).
_GGUF_SANDWICH_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's converter permutes q/k rows (see _unpermute_rope_rows) for the models it runs
# with interleaved-pair RoPE: the llama architecture. Qwen2, Qwen3 and Gemma 3 files keep
# Hugging Face's rotate-half rows (llama.cpp's "NEOX" RoPE).
_ROPE_PERMUTED_ARCHITECTURES = ("LlamaForCausalLM",)
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def iter_weights(
    source: ModelSource,
    config: ModelConfig,
    stage: StageSpec,
    dtype: torch.dtype,
    skip: Container[str] = (),
    shard_of: ShardOf = _whole,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor) for the weights of the stage's layers.

    The first stage gets the embedding; the last gets the final norm and lm_head, or, when the
    embeddings are tied, "model.embed_tokens.weight" to use as lm_head. Attention biases are
    yielded when the checkpoint has them. Only the stage's tensors are read from disk, less
    those named in `skip` (weights the stage takes quantized, see iter_quantized_weights).
    With tensor parallelism, `shard_of` names the rows or columns of each tensor this rank
    holds, and only those are read (and dequantized).
    """
    needed = _Stage(config, stage, skip, shard_of)
    if source.kind == "hf":
        yield from _iter_safetensors(source.path, needed, dtype)
    else:
        yield from _iter_gguf(source.path, needed, dtype)


@dataclass(frozen=True)
class _Stage:
    """The weights one stage reads."""

    config: ModelConfig
    spec: StageSpec
    skip: Container[str] = ()
    shard_of: ShardOf = _whole

    def __post_init__(self) -> None:
        start, end = self.spec.layer_start, self.spec.layer_end
        if not 0 <= start <= end <= self.config.num_hidden_layers:
            raise ValueError(
                f"layer range [{start}, {end}) is outside the model's "
                f"{self.config.num_hidden_layers} layers"
            )

    def weight_names(self, available: Container[str]) -> Iterator[str]:
        """The Hugging Face names this stage needs, biases included where `available` has them,
        less those in `skip`."""
        return (name for name in self._all_weight_names(available) if name not in self.skip)

    def _all_weight_names(self, available: Container[str]) -> Iterator[str]:
        spec = self.spec
        if spec.is_first or (spec.is_last and self.config.tie_word_embeddings):
            yield "model.embed_tokens.weight"
        parts = _LAYER_WEIGHTS
        parts += _QK_NORMS if self.config.qk_norm else ()
        parts += _SANDWICH_NORMS if self.config.sandwich_norms else ()
        for layer in range(spec.layer_start, spec.layer_end):
            prefix = f"model.layers.{layer}."
            yield from (f"{prefix}{part}.weight" for part in parts)
            for projection in _BIASED_PROJECTIONS:
                if f"{prefix}{projection}.bias" in available:
                    yield f"{prefix}{projection}.bias"
        if spec.is_last:
            yield "model.norm.weight"
            if not self.config.tie_word_embeddings:
                yield "lm_head.weight"


def _missing(path: Path, name: str) -> ValueError:
    return ValueError(f"checkpoint {path} has no tensor {name!r}, which this model needs")


def _iter_safetensors(
    folder: Path, stage: _Stage, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    offset = stage.config.norm_weight_offset
    for name, tensor in _iter_safetensors_as_stored(folder, stage, dtype):
        # Gemma's norms store w for a (1 + w) scale: the model's norms take the scale itself.
        yield name, tensor.add(offset) if offset and name.endswith("norm.weight") else tensor


def _iter_safetensors_as_stored(
    folder: Path, stage: _Stage, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    file_of = _safetensors_file_map(folder)
    with ExitStack() as stack:
        # Shards open on first use: a stage touches only the shards holding its layers.
        handles = {}
        for name in stage.weight_names(file_of):
            file = file_of.get(name)
            if file is None:
                raise _missing(folder, name)
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            shard = stage.shard_of(name)
            if shard is None:
                yield name, handles[file].get_tensor(name).to(dtype)
                continue
            part = handles[file].get_slice(name)  # reads only the rank's rows or columns
            index = slice(shard.start, shard.stop)
            yield name, (part[index] if shard.dim == 0 else part[:, index]).to(dtype)


def _safetensors_file_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    file_of = {}
    for file in sorted(folder.glob("*.safetensors")):
        # Reading a file's keys parses only its small JSON header.
        with safe_open(file, framework="pt") as handle:
            file_of.update(dict.fromkeys(handle.keys(), file))
    return file_of


def iter_quantized_weights(
    source: ModelSource,
    config: ModelConfig,
    stage: StageSpec,
    shard_of: ShardOf = _whole,
) -> Iterator[tuple[str, QuantizedWeight]]:
    """Like iter_weights, but only the GGUF matrices pipellm's kernels take as stored
    (GGUF_KERNEL_TYPES), in their file bytes (rows in Hugging Face order); nothing for a
    safetensors checkpoint."""
    if source.kind != "gguf":
        return
    tensors = _gguf_tensors(source.path, config)
    for name in _Stage(config, stage).weight_names(tensors):
        tensor = tensors.get(name)
        if (
            tensor is not None
            and tensor.tensor_type in GGUF_KERNEL_TYPES
            and len(tensor.shape) == 2
        ):
            blocks = _hf_shard(name, tensor, shard_of(name), config, _own_bytes)
            yield name, QuantizedWeight(tensor.tensor_type, blocks)


def check_gguf_kernel_types(source: ModelSource, config: ModelConfig) -> None:
    """Raises ValueError naming the first matrix the model uses whose GGUF type pipellm's
    kernels do not compute on (they would otherwise be dequantized to float32: 4-12x the
    memory and the decode step's weight stream)."""
    for name, tensor in _gguf_tensors(source.path, config).items():
        kind = tensor.tensor_type
        if len(tensor.shape) == 2 and kind not in GGUF_KERNEL_TYPES | {
            gguf.GGMLQuantizationType.F32
        }:
            supported = ", ".join(sorted(t.name for t in GGUF_KERNEL_TYPES))
            raise ValueError(
                f"{source.path}: tensor {tensor.name!r} ({name}) is {kind.name}, which pipellm's "
                f"GGUF kernels do not compute on (they take {supported} and F32); re-quantize "
                f"the file to one of those (llama.cpp's llama-quantize), or set "
                f"quantization='none' to load it dequantized to float32"
            )


def stage_weight_names(
    config: ModelConfig, stage: StageSpec, available: Container[str]
) -> Iterator[str]:
    """The Hugging Face names of the weights a stage loads (biases where `available` has
    them), without reading any."""
    return _Stage(config, stage).weight_names(available)


def gguf_tensor_index(path: Path, config: ModelConfig) -> dict[str, TensorEntry]:
    """The GGUF file's tensors the model uses, by Hugging Face name, from its header only."""
    entries = {}
    for entry in read_tensor_index(path):
        hf_name = _hf_name(entry.name, _layer_names(config))
        if hf_name is not None:
            entries[hf_name] = entry
    return entries


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of all a GGUF file's tensors, as stored."""
    return sum(entry.n_bytes for entry in read_tensor_index(path))


def check_gguf_tensor_parallel(
    source: ModelSource, config: ModelConfig, plans: list[TensorParallelPlan]
) -> None:
    """Raises TensorParallelError if a rank's columns of a quantized row-parallel weight
    (o_proj, down_proj) would cut through its GGUF blocks."""
    for name, tensor in _gguf_tensors(source.path, config).items():
        block_values, _ = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        if block_values > 1:
            for plan in plans:
                check_row_split(plan, name, block_values)


def _layer_names(config: ModelConfig) -> dict[str, str]:
    """llama.cpp's per-layer tensor names -> Hugging Face's, for this model's layout."""
    if config.sandwich_norms:
        return {**_GGUF_LAYER_NAMES, **_GGUF_SANDWICH_NAMES}
    return _GGUF_LAYER_NAMES


def _gguf_tensors(path: Path, config: ModelConfig) -> dict[str, gguf.ReaderTensor]:
    """The file's tensors by Hugging Face name (those the model uses), as views of a fresh
    map of the file: a stage touches only its own tensors' pages, and once its load drops
    the views the map and the pages go (loader/gguf_tensors.py)."""
    layer_names = _layer_names(config)
    tensors = {}
    for tensor in map_tensors(path):
        hf_name = _hf_name(tensor.name, layer_names)
        if hf_name is not None:
            tensors[hf_name] = tensor
    return tensors


def _iter_gguf(path: Path, stage: _Stage, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = _gguf_tensors(path, stage.config)
    for name in stage.weight_names(tensors):
        if name not in tensors:
            raise _missing(path, name)
        tensor = tensors[name]
        rows = _hf_shard(name, tensor, stage.shard_of(name), stage.config, _dequantize)
        yield name, rows.to(dtype)


def _own_bytes(tensor: gguf.ReaderTensor, data: np.ndarray) -> torch.Tensor:
    """Rows [rows, bytes] as they are in the file (gguf reads float16 ones as float16: viewed
    back as their bytes): owned, off the map."""
    del tensor
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())


def _hf_shard(
    name: str,
    tensor: gguf.ReaderTensor,
    shard: WeightShard | None,
    config: ModelConfig,
    convert: Callable[[gguf.ReaderTensor, np.ndarray], torch.Tensor],
) -> torch.Tensor:
    """The rank's part of a GGUF tensor in Hugging Face row order, `convert`ed (dequantized, or
    kept as block bytes). q/k rows are permuted within each head in the file (_hf_rows): a
    part that cuts a head (tensor parallelism by rows, model/tp_plan.py) reads the heads it
    touches whole, unpermutes them, then keeps its rows."""
    if shard is not None and shard.dim == 0 and _is_rope_permuted(name, config):
        d = config.head_dim
        first, stop = shard.start // d * d, -(-shard.stop // d) * d
        whole_heads = dataclasses.replace(shard, start=first, stop=stop)
        rows = _hf_rows(name, convert(tensor, _shard_data(name, tensor, whole_heads)), config)
        return rows[shard.start - first : shard.stop - first]
    return _hf_rows(name, convert(tensor, _shard_data(name, tensor, shard)), config)


def _shard_data(name: str, tensor: gguf.ReaderTensor, shard: WeightShard | None) -> np.ndarray:
    """The rank's rows or columns of a GGUF tensor's data, still in file bytes (quantized
    rows are [rows, bytes]: a column split must fall on its blocks' boundaries)."""
    data = tensor.data
    if shard is None:
        return data
    if shard.dim == 0:
        return data[shard.start : shard.stop]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    if shard.start % block_values or shard.stop % block_values:
        raise TensorParallelError(
            f"{name}: this rank's input columns [{shard.start}, {shard.stop}) do not fall on "
            f"the GGUF blocks of {block_values} values; use another tensor_parallel_size"
        )
    start, stop = shard.start // block_values, shard.stop // block_values
    return np.ascontiguousarray(data[:, start * block_bytes : stop * block_bytes])


def _hf_rows(name: str, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama.cpp's converter permutes q/k rows for its rope layout; the model uses HF's. Works
    on dequantized weights and on quantized block rows alike: each row is one output."""
    if _is_rope_permuted(name, config):
        # Per head: a tensor-parallel rank's whole heads unpermute alike.
        return _unpermute_rope_rows(rows, rows.shape[0] // config.head_dim)
    return rows


def _is_rope_permuted(name: str, config: ModelConfig) -> bool:
    if config.architecture not in _ROPE_PERMUTED_ARCHITECTURES:
        return False
    return ".q_proj." in name or ".k_proj." in name


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    """The Hugging Face name of a llama.cpp tensor; None for tensors the model does not use."""
    base, suffix = gguf_name.rsplit(".", 1)  # e.g. "blk.3.attn_q", "weight"
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf_part = layer_names.get(part)
        return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{suffix}"
    hf_base = _GGUF_GLOBAL_NAMES.get(base)
    return None if hf_base is None else f"{hf_base}.{suffix}"


def _dequantize(tensor: gguf.ReaderTensor, data: np.ndarray) -> torch.Tensor:
    """`data` (all or part of the tensor's) as float32 in Hugging Face's [out, in] shape (GGUF
    lists dimensions reversed)."""
    array = gguf.quants.dequantize(data, tensor.tensor_type)
    if len(tensor.shape) > 1:
        array = array.reshape(data.shape[0], -1)
    # Unquantized tensors come back as views of the read-only memory map; torch wants to own them.
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf.py's `permute` for q (query heads) or k (key/value heads).

    The converter reorders each head's rows from HF's rotate-half layout (first half, second
    half) to llama.cpp's interleaved pairs: reshape(heads, 2, d/2) -> swap -> (heads, d/2, 2).
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )
