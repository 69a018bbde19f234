"""IncrementalDetokenizer: deltas add up to decode(all ids), never splitting a character."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from pipellm.loader.source import resolve_model
from pipellm.text.detokenizer import IncrementalDetokenizer
from pipellm.text.tokenizer import Tokenizer, load_tokenizer
from tests.checkpoints import make_tiny_tokenizer
from tests.gguf_tokenizer_files import write_sentencepiece_gguf

TEXTS = [
    "plain ascii, with spaces  and\nnewlines",
    "日本語のテキスト",  # 3-byte characters: the tiny tokenizer splits them into byte tokens
    "Emoji 😀👍🏽🇺🇸 and ❤️ in a row",
    "Ünïcödé mixed with ascii",
    "<|im_start|>assistant\nSalut 👋<|im_end|>",
]


def _wrap(backend: tokenizers.Tokenizer) -> Tokenizer:
    return Tokenizer(
        backend, bos_token_id=None, eos_token_ids=(), chat_template=None, add_bos_token=False
    )


@pytest.fixture(scope="module", params=["tiny", "smollm2", "sentencepiece-gguf"])
def tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Tokenizer:
    if request.param == "tiny":
        return _wrap(make_tiny_tokenizer())
    if request.param == "sentencepiece-gguf":  # "▁" spaces, a space prefix, <0xXX> bytes
        path = write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
        return load_tokenizer(resolve_model(str(path)))
    return load_tokenizer(resolve_model(None))


def _stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add_token(token_id) for token_id in ids]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_add_up_to_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        deltas = _stream(detokenizer, ids)
        assert detokenizer.flush() == ""
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert not any("\ufffd" in delta for delta in deltas), text


def test_split_characters_are_held_back() -> None:
    tokenizer = _wrap(make_tiny_tokenizer())
    ids = tokenizer.encode("語")  # unseen in training: one token per UTF-8 byte
    assert len(ids) == 3
    assert _stream(IncrementalDetokenizer(tokenizer), ids) == ["", "", "語"]


def test_flush_returns_an_unfinished_character() -> None:
    tokenizer = _wrap(make_tiny_tokenizer())
    ids = tokenizer.encode("a語")[:-1]  # the stream stops inside the character
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(_stream(detokenizer, ids)) == "a"
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""


def test_prompt_context_keeps_the_first_space() -> None:
    """SentencePiece-style decoders drop a first word's space; after a prompt it must stay."""
    backend = tokenizers.Tokenizer(
        models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = _wrap(backend)
    assert tokenizer.decode([1, 2]) == "world!"
    assert _stream(IncrementalDetokenizer(tokenizer), [1, 2]) == ["world", "!"]
    with_prompt = IncrementalDetokenizer(tokenizer, prompt_ids=[0])
    assert _stream(with_prompt, [1, 2]) == [" world", "!"]
