"""GGUF tokenizers give llama.cpp's ids: SentencePiece and byte-level BPE under every kind of
pre-tokenizer, on the real files and on small ones written by tests/gguf_tokenizer_files.py."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pipellm.loader.source import resolve_model
from pipellm.text.tokenizer import Tokenizer, load_tokenizer
from tests.gguf_models import require_gemma3_270m_gguf
from tests.gguf_tokenizer_files import (
    KINDS,
    REFERENCE_FILE,
    llama_cpp_ids,
    stored_ids,
    strings_of,
    tokenizer_test_strings,
)

REFERENCES = json.loads(REFERENCE_FILE.read_text())
STRINGS: list[str] = REFERENCES["strings"]
SPACE_PREFIX_KINDS = {"spm-llama2"}  # SentencePiece files that put a space before the text


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:  # absent, or its shared library is missing
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
