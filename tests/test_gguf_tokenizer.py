"""GGUF tokenizers give llama.cpp's ids: SentencePiece and byte-level BPE under every kind of
pre-tokenizer, on the real files and on small ones written by tests/gguf_tokenizer_files.py."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Regex, pre_tokenizers

from pipellm.config import ConfigError, EngineConfig
from pipellm.loader.source import resolve_model
from pipellm.text.gguf_pretokenizers import RULES
from pipellm.text.gguf_tokenizer import UnsupportedTokenizerError, check_gguf_tokenizer
from pipellm.text.tokenizer import Tokenizer, load_tokenizer
from tests.gguf_models import require_gemma3_270m_gguf
from tests.gguf_tokenizer_files import (
    KINDS,
    REFERENCE_FILE,
    llama_cpp_ids,
    stored_ids,
    strings_of,
    tokenizer_test_strings,
    write_byte_level_gguf,
)

REFERENCES = json.loads(REFERENCE_FILE.read_text())
STRINGS: list[str] = REFERENCES["strings"]
SPACE_PREFIX_KINDS = {"spm-llama2"}  # SentencePiece files that put a space before the text


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # absent, or its shared library is missing
        return False
    return True


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The file of a tokenizer kind, written once per module where the tests write it."""
    folder = tmp_path_factory.mktemp("gguf-tokenizers")

    @functools.cache
    def locate(kind: str) -> Path:
        return require_gemma3_270m_gguf() if kind == "gemma3" else KINDS[kind](folder)

    return locate


@functools.cache
def _tokenizer(path: Path) -> Tokenizer:
    return load_tokenizer(resolve_model(str(path)))


def _mismatches(strings: list[str], ours: list[list[int]], theirs: list[list[int]]) -> list[str]:
    return [
        f"{text!r}: pipellm {a} != llama.cpp {b}"
        for text, a, b in zip(strings, ours, theirs, strict=True)
        if a != b
    ]


@pytest.mark.parametrize("kind", list(KINDS))
def test_ids_equal_llama_cpps(kind: str, gguf_file: Callable[[str], Path]) -> None:
    """Every string encodes as llama.cpp encodes it (the stored ids), special tokens and BOS
    included, and decodes back to the text."""
    tokenizer = _tokenizer(gguf_file(kind))
    strings = strings_of(kind, STRINGS)
    ours = [tokenizer.encode(text) for text in strings]
    wrong = _mismatches(strings, ours, stored_ids(REFERENCES, kind))
    assert not wrong, f"{len(wrong)} of {len(strings)} differ:\n" + "\n".join(wrong[:10])

    added = tokenizer.backend.get_added_tokens_decoder()
    for text in strings:
        ids = tokenizer.encode(text, add_special_tokens=False)
        # SentencePiece's space prefix also follows every special token (llama.cpp's rule),
        # so there only texts without one come back unchanged.
        if kind in SPACE_PREFIX_KINDS and any(i in added for i in ids):
            continue
        # SentencePiece reads a "▁" in the text as a space.
        expected = text if kind.startswith("bpe-") or kind == "smollm" else text.replace("▁", " ")
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected, (text, ids)


@pytest.mark.skipif(not _has_llama_cpp(), reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("kind", list(KINDS))
def test_stored_ids_are_llama_cpps_today(kind: str, gguf_file: Callable[[str], Path]) -> None:
    """The stored reference is what llama.cpp gives now (regenerate it with
    `python -m tests.gguf_tokenizer_files` after a deliberate change)."""
    assert STRINGS == tokenizer_test_strings()
    strings = strings_of(kind, STRINGS)
    theirs = llama_cpp_ids(gguf_file(kind), strings)
    wrong = _mismatches(strings, theirs, stored_ids(REFERENCES, kind))
    assert not wrong, "\n".join(wrong[:10])


def test_gemma3_bos_eos_and_special_tokens() -> None:
    """Gemma: BOS 2 added, EOS 1 and <end_of_turn> end generation, no chat template (a base
    model); control tokens are dropped from text, user-defined ones (HTML tags) are text."""
    gemma = _tokenizer(require_gemma3_270m_gguf())
    assert (gemma.bos_token_id, gemma.eos_token_ids) == (2, (1, 106))
    assert gemma.backend.id_to_token(106) == "<end_of_turn>"
    assert gemma.chat_template is None
    assert gemma.encode("Hi")[0] == 2 and gemma.encode("Hi", add_special_tokens=False)[0] != 2
    ids = gemma.encode("<start_of_turn>user\n<b>Hi</b><end_of_turn>")
    assert gemma.decode(ids) == "user\n<b>Hi</b>"
    assert gemma.decode(ids, skip_special_tokens=False) == (
        "<bos><start_of_turn>user\n<b>Hi</b><end_of_turn>"
    )


def test_chat_template_comes_from_the_file(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_byte_level_gguf(tmp_path / "t.gguf", "llama-bpe", chat_template=template)
    tokenizer = _tokenizer(path)
    assert tokenizer.chat_template == template
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == "Hi"


@pytest.mark.parametrize(
    ("model", "pre", "key"),
    [("bert", "default", "tokenizer.ggml.model"), ("gpt2", "made-up", "tokenizer.ggml.pre")],
)
def test_unsupported_tokenizer_fails_before_any_process(
    model: str, pre: str, key: str, tmp_path: Path
) -> None:
    path = write_byte_level_gguf(tmp_path / "t.gguf", pre, model=model)
    value = model if key.endswith("model") else pre
    with pytest.raises(UnsupportedTokenizerError, match=rf"{key} = '{value}' is not supported"):
        check_gguf_tokenizer(path)
    with pytest.raises(ConfigError, match=rf"{key} = '{value}' is not supported"):
        EngineConfig(model=str(path), load_format="dummy")


def test_every_pre_tokenizer_rule_compiles() -> None:
    """The rules the stored ids do not cover still build and split (names are aliases of the
    covered rules or differ only in their flags)."""
    for name, rule in RULES.items():
        splitter = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), "isolated") for regex in rule.regexes]
        )
        pieces = [piece for piece, _ in splitter.pre_tokenize_str("Hi there 12345 日本")]
        assert "".join(pieces) == "Hi there 12345 日本", name
