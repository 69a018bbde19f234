"""Prompts for the serving benchmark: random token prompts and ShareGPT first turns."""

import json
import math
import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Random prompts: rounds of extending or cutting the text towards the exact token count, and
# how far from the estimated cut to look for one that hits it.
MAX_FIXUP_ROUNDS = 10
CUT_WINDOW = 2

# ShareGPT filter: drop very short turns and anything longer than a small model's context.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class TokenizerLike(Protocol):
    """What the datasets need from a tokenizer (pipellm's Tokenizer has it)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt, its length in tokens and the tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds [floor(L(1-r)), ceil(L(1+r))], raised to at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    # Rounding first keeps float noise (100 * 1.1 = 110.00000000000001) out of floor/ceil.
    low = math.floor(round(length * (1 - range_ratio), 6))
    high = math.ceil(round(length * (1 + range_ratio), 6))
    return max(low, 1), max(high, 1)


def sample_random_requests(
    tokenizer: TokenizerLike,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random tokens sharing a random prefix of prefix_len tokens.

    Each prompt encodes (special tokens included, as the server counts them) to prefix_len plus
    a length drawn uniformly from length_range(input_len, range_ratio); prompt_len is the length
    actually reached, which differs only if the fix-up rounds run out.
    """
    rng = np.random.default_rng(seed)
    input_low, input_high = length_range(input_len, range_ratio)
    output_low, output_high = length_range(output_len, range_ratio)
    vocab = _plain_token_ids(tokenizer)
    num_special = len(tokenizer.encode(""))
    prefix = ""
    if prefix_len:
        prefix = _random_text(tokenizer, vocab, "", prefix_len + num_special, rng)[0]
    requests = []
    # One request's draws at a time, so the first n requests never depend on num_requests.
    for _ in range(num_requests):
        body_len = int(rng.integers(input_low, input_high + 1))
        num_output = int(rng.integers(output_low, output_high + 1))
        prompt, prompt_len = _random_text(tokenizer, vocab, prefix, prefix_len + body_len, rng)
        requests.append(SampleRequest(prompt, prompt_len, num_output))
    return requests


def _plain_token_ids(tokenizer: TokenizerLike) -> np.ndarray:
    """Ids that decode to text of their own and encode back to themselves.

    Drawing only these keeps special tokens and partial UTF-8 byte tokens (which decode to
    replacement characters) out of the prompts, so lengths move predictably.
    """
    plain = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text and "\ufffd" not in text:
            if tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                plain.append(token_id)
    if not plain:
        raise ValueError("the tokenizer has no token that decodes to text and back")
    return np.array(plain)


def _random_text(
    tokenizer: TokenizerLike,
    vocab: np.ndarray,
    prefix: str,
    target_len: int,
    rng: np.random.Generator,
) -> tuple[str, int]:
    """prefix followed by random text, encoding to target_len tokens; returns (text, length).

    Each round extends a short body with random tokens or cuts a long one, working on the body's
    canonical ids (its own re-encoding, which decodes back to it). A cut inside a multi-byte
    character decodes to a replacement character worth a token or more, so cuts near the
    estimate are tried too, and a later round's new random tokens give other choices.
    """
    body_text = ""
    length = len(tokenizer.encode(prefix))
    for _ in range(MAX_FIXUP_ROUNDS):
        if length == target_len:
            break
        body = tokenizer.encode(body_text, add_special_tokens=False)
        if length < target_len:
            body_text = tokenizer.decode(body + rng.choice(vocab, target_len - length).tolist())
            length = len(tokenizer.encode(prefix + body_text))
        else:
            body_text, length = _best_cut(tokenizer, prefix, body, target_len, length)
    return prefix + body_text, length


def _best_cut(
    tokenizer: TokenizerLike, prefix: str, body: list[int], target_len: int, length: int
) -> tuple[str, int]:
    """Text of the cut of body, near the estimated one, whose length comes closest to target_len.

    length is what prefix + the whole body encodes to.
    """
    estimate = max(0, len(body) - (length - target_len))
    best: tuple[str, int] | None = None
    for offset in range(2 * CUT_WINDOW + 1):
        # Cuts in the order estimate, estimate - 1, estimate + 1, estimate - 2, ...
        cut = estimate + (offset + 1) // 2 * (-1 if offset % 2 else 1)
        if not 0 <= cut <= len(body):
            continue
        body_text = tokenizer.decode(body[:cut])
        cut_len = len(tokenizer.encode(prefix + body_text))
        if best is None or abs(cut_len - target_len) < abs(best[1] - target_len):
            best = (body_text, cut_len)
        if cut_len == target_len:
            break
    assert best is not None, "the estimate itself is always in range"
    return best


def sample_sharegpt_requests(
    tokenizer: TokenizerLike,
    path: str,
    num_requests: int,
    seed: int = 0,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """First human turn as prompt, first reply's length as output length, from a ShareGPT JSON.

    Conversations are shuffled with the seed; turns under SHAREGPT_MIN_LEN tokens or over the
    length limits are skipped (the output check is skipped when output_len fixes the length).
    If too few remain, they are repeated to reach num_requests.
    """
    with open(path) as f:
        conversations = [entry["conversations"] for entry in json.load(f)]
    conversations = [turns for turns in conversations if len(turns) >= 2]
    random.Random(seed).shuffle(conversations)
    requests: list[SampleRequest] = []
    for turns in conversations:
        if len(requests) == num_requests:
            break
        prompt = turns[0]["value"]
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = output_len or len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        too_short = prompt_len < SHAREGPT_MIN_LEN or (
            output_len is None and reply_len < SHAREGPT_MIN_LEN
        )
        too_long = (
            prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_LEN
        )
        if not too_short and not too_long:
            requests.append(SampleRequest(prompt, prompt_len, reply_len))
    if not requests:
        raise ValueError(f"--dataset-path {path}: no conversation passed the ShareGPT filter")
    return [requests[i % len(requests)] for i in range(num_requests)]
