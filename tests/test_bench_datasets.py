"""Benchmark datasets: exact random prompt lengths through a real tokenizer, ShareGPT filtering."""

import json
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pipellm.bench.datasets import (
    SampleRequest,
    length_range,
    sample_random_requests,
    sample_sharegpt_requests,
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Pipeline parallelism keeps every stage of the model busy at the same time.",
    "Héllo wörld, ça va? 你好，世界！ Ünïcödé makes byte-level merges interesting.",
    "Serving benchmarks measure time to first token and inter-token latency.",
]


class TinyTokenizer:
    """A byte-level BPE trained on a few sentences, with pipellm's Tokenizer interface."""

    def __init__(self, add_bos: bool = False) -> None:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(TRAINING_TEXT * 5, trainer)
        if add_bos:
            backend.post_processor = processors.TemplateProcessing(
                single="<s> $A", special_tokens=[("<s>", 0)]
            )
        self.backend = backend

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "bos"])
def tokenizer(request: pytest.FixtureRequest) -> TinyTokenizer:
    return TinyTokenizer(add_bos=request.param)


@pytest.mark.parametrize(
    "length, ratio, bounds",
    [(4000, 0.0, (4000, 4000)), (100, 0.1, (90, 110)), (10, 0.25, (7, 13)), (1, 0.5, (1, 2))],
)
def test_length_range(length: int, ratio: float, bounds: tuple[int, int]) -> None:
    assert length_range(length, ratio) == bounds


@pytest.mark.parametrize("ratio", [1.0, -0.1])
def test_length_range_rejects_ratio_outside_0_1(ratio: float) -> None:
    with pytest.raises(ValueError, match="--random-range-ratio"):
        length_range(10, ratio)


def test_random_prompts_have_exact_lengths(tokenizer: TinyTokenizer) -> None:
    requests = sample_random_requests(tokenizer, 40, input_len=64, output_len=7, seed=3)
    assert [r.prompt_len for r in requests] == [64] * 40
    assert [len(tokenizer.encode(r.prompt)) for r in requests] == [64] * 40
    assert [r.output_len for r in requests] == [7] * 40


def test_random_lengths_cover_the_documented_range(tokenizer: TinyTokenizer) -> None:
    requests = sample_random_requests(tokenizer, 300, 10, 20, range_ratio=0.5, seed=0)
    assert {r.prompt_len for r in requests} == set(range(5, 16))
    assert {r.output_len for r in requests} == set(range(10, 31))
    assert all(len(tokenizer.encode(r.prompt)) == r.prompt_len for r in requests)


def test_random_prompts_share_the_prefix(tokenizer: TinyTokenizer) -> None:
    requests = sample_random_requests(tokenizer, 10, 20, 4, prefix_len=12, seed=1)
    prefix = os.path.commonprefix([r.prompt for r in requests])
    assert len(tokenizer.encode(prefix, add_special_tokens=False)) == 12
    assert [r.prompt_len for r in requests] == [32] * 10
    assert all(len(tokenizer.encode(r.prompt)) == 32 for r in requests)


def test_same_seed_same_prompts(tokenizer: TinyTokenizer) -> None:
    def sample(seed: int) -> list[SampleRequest]:
        return sample_random_requests(tokenizer, 8, 30, 5, range_ratio=0.3, seed=seed)

    assert sample(7) == sample(7)
    assert [r.prompt for r in sample(7)] != [r.prompt for r in sample(8)]
    # Warmups are sampled after the timed requests: asking for more leaves the first ones alone.
    more = sample_random_requests(tokenizer, 12, 30, 5, range_ratio=0.3, seed=7)
    assert more[:8] == sample(7)


def _conversation(*turns: str) -> dict:
    roles = ["human", "gpt"]
    return {"conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]}


@pytest.fixture
def sharegpt_file(tmp_path) -> str:
    long_text = "The quick brown fox jumps over the lazy dog. " * 120
    data = [
        _conversation("Tell me about pipeline parallelism please.", "It keeps stages busy."),
        _conversation("hi", "The quick brown fox jumps over the lazy dog."),  # prompt too short
        _conversation("Serving benchmarks measure time to first token."),  # no reply
        _conversation(long_text, "ok ok ok ok ok"),  # prompt over the limit
        _conversation("What does the quick brown fox do?", "ok"),  # reply too short
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt_keeps_valid_first_turns(sharegpt_file: str) -> None:
    tokenizer = TinyTokenizer()
    requests = sample_sharegpt_requests(tokenizer, sharegpt_file, 3, seed=0)
    prompt = "Tell me about pipeline parallelism please."
    reply_len = len(tokenizer.encode("It keeps stages busy.", add_special_tokens=False))
    # Only one conversation passes; it is repeated to reach the count.
    assert requests == [SampleRequest(prompt, len(tokenizer.encode(prompt)), reply_len)] * 3


def test_sharegpt_fixed_output_len_skips_the_reply_check(sharegpt_file: str) -> None:
    requests = sample_sharegpt_requests(TinyTokenizer(), sharegpt_file, 4, seed=5, output_len=9)
    assert {r.prompt for r in requests} == {
        "Tell me about pipeline parallelism please.",
        "What does the quick brown fox do?",
    }
    assert {r.output_len for r in requests} == {9}


def test_sharegpt_without_valid_conversation_fails(tmp_path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps([_conversation("hi", "yo")]))
    with pytest.raises(ValueError, match="no conversation passed"):
        sample_sharegpt_requests(TinyTokenizer(), str(path), 1)
