"""Tokenizer: Hugging Face folders match transformers; the GGUF rebuild of SmolLM2's round-trips."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from pipellm.loader.source import resolve_model
from pipellm.text.tokenizer import Tokenizer, load_tokenizer
from tests.checkpoints import make_tiny_checkpoint

TEXTS = [
    "Hello, world!",
    "",
    " leading space and trailing space ",
    "multiple   spaces\n\nblank lines\r\n\ttabs",
    "Le café naïve, Über Straße, Ångström",
    "日本語のテキスト、中文，한국어",
    "Emoji 😀👍🏽🇺🇸 ❤️ and a family 👨‍👩‍👧",
    "digits 1234567890, 3.14159 and 1,000,000",
    "code:\n    def f(x):\n        return x ** 2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2? 🤔"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", num_layers=1)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_tokenizer(resolve_model(None))


def test_hf_folder_matches_transformers(tiny_dir: Path) -> None:
    ours = load_tokenizer(resolve_model(str(tiny_dir)))
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text).input_ids, text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == (
            theirs.apply_chat_template(
                MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_ids) == (300, 1, (2,))


def test_hf_folder_config_variants(tmp_path: Path, tiny_dir: Path) -> None:
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    tokenizer_config = {
        "bos_token": {"content": "<|endoftext|>", "special": True},  # a serialized AddedToken
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = load_tokenizer(resolve_model(str(tmp_path)))
    assert tokenizer.bos_token_id == 0
    assert tokenizer.encode("Hi")[0] == 0 and tokenizer.encode("Hi", False)[0] != 0
    assert tokenizer.apply_chat_template(MESSAGES) == "<|endoftext|>Be brief."
    # transformers >= 4.43 writes the template to its own file, which wins.
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    assert load_tokenizer(resolve_model(str(tmp_path))).apply_chat_template(MESSAGES) == (
        "<|im_end|>"
    )


def test_chat_template_errors(tmp_path: Path, tiny_dir: Path) -> None:
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(resolve_model(str(tmp_path))).apply_chat_template(MESSAGES)
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    (tmp_path / "chat_template.jinja").write_text(strict)
    with pytest.raises(ValueError, match="user first"):
        load_tokenizer(resolve_model(str(tmp_path))).apply_chat_template(MESSAGES)
    # The sandbox keeps templates away from Python internals.
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="unsafe"):
        load_tokenizer(resolve_model(str(tmp_path))).apply_chat_template(MESSAGES)


def test_smollm2_special_tokens_and_ids(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    # <|im_end|> is EOS; <|endoftext|> ends generation too, as in llama.cpp.
    assert (smollm2.bos_token_id, smollm2.eos_token_ids) == (1, (2, 0))
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    assert smollm2.encode("<|endoftext|>") == [0]
    assert smollm2.encode("Hello") == [19556]  # no BOS: SmolLM2 adds none
    # Digits are split one by one, as in SmolLM2's tokenizer.json.
    assert len(smollm2.encode("1234567890")) == 10
    assert smollm2.decode([1, 19556, 2]) == "Hello"
    assert smollm2.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


def test_smollm2_round_trips(smollm2: Tokenizer) -> None:
    for text in TEXTS:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids, skip_special_tokens=False) == text
        assert all(0 <= i < smollm2.vocab_size for i in ids)


def test_smollm2_matches_transformers_gguf_tokenizer(
    smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers builds its own tokenizer from the same GGUF metadata: an independent check."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: the file is local anyway
    path = resolve_model(None).path
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert smollm2.encode(text) == theirs(text).input_ids, text


def test_smollm2_chat_template(smollm2: Tokenizer) -> None:
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm2.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
