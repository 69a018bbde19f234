"""What pipellm does not run is refused before any process starts, and the error names the
config or GGUF metadata key and its value."""

from __future__ import annotations

import json
import re

import pytest

from pipellm import LLM
from tests.checkpoints import make_tiny_checkpoint, write_tiny_gguf


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"))


def _edited_config(llama_dir, tmp_path, **fields):
    """A copy of the tiny checkpoint whose config.json has `fields` set."""
    folder = tmp_path / "edited"
    folder.mkdir()
    for file in llama_dir.iterdir():
        (folder / file.name).symlink_to(file)
    config = json.loads((llama_dir / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


def _refused(model, *named: str) -> None:
    """LLM(model) on two stages fails before it starts them (UnsupportedModelError, or
    ConfigError for settings the engine config checks), naming each of `named`."""
    with pytest.raises(ValueError) as refusal, LLM(str(model), pipeline_parallel_size=2):
        pass
    for text in named:
        assert re.search(re.escape(text), str(refusal.value)), (text, str(refusal.value))


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(architectures=["Phi3ForCausalLM"]), ["architectures[0]", "'Phi3ForCausalLM'"]),
        (
            dict(rope_parameters={"rope_theta": 1e4, "rope_type": "longrope"}),
            ["rope_scaling type", "'longrope'"],
        ),
        (
            dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
            ["rope_scaling type", "'dynamic'"],
        ),
        (dict(final_logit_softcapping=30.0), ["final_logit_softcapping", "30.0"]),
        (dict(hidden_act="gelu"), ["hidden_act", "'gelu'"]),
    ],
    ids=["architecture", "rope-parameters", "rope-scaling", "softcapping", "activation"],
)
def test_hugging_face_config(llama_dir, tmp_path, reaped, fields, named):
    _refused(_edited_config(llama_dir, tmp_path, **fields), *named)


def test_gguf_architecture(llama_dir, tmp_path, reaped):
    path = write_tiny_gguf(llama_dir, tmp_path / "phi3.gguf", architecture="phi3")
    _refused(path, "general.architecture", "'phi3'")


def test_gguf_rope_scaling(llama_dir, tmp_path, reaped):
    path = write_tiny_gguf(
        llama_dir, tmp_path / "yarn.gguf", metadata={"llama.rope.scaling.type": "yarn"}
    )
    _refused(path, "llama.rope.scaling.type", "'yarn'")


def test_gguf_tokenizer(llama_dir, tmp_path, reaped):
    path = write_tiny_gguf(llama_dir, tmp_path / "rwkv.gguf", tokenizer_model="rwkv")
    _refused(path, "'rwkv'")
