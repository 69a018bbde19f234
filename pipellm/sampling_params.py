"""Per-request sampling settings, validated on construction (vLLM's names and defaults)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pipellm.structured_outputs import StructuredOutputsParams

# The sampler works in float32, where 1e-300 is 0 and 1e300 is inf: values that would divide by
# zero or give NaN probabilities are raised to these floors (vLLM raises temperatures below
# 0.01 the same way, vllm/sampling_params.py) or refused.
MIN_TEMPERATURE = 0.01  # (0, 0.01) is raised to it; 0 stays greedy
MIN_TOP_P = 1e-8  # (0, 1e-8) is raised to it: keeps the likeliest token only, as any tiny p
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits are divided or multiplied by it
FLOAT32_MAX = 3.4028234663852886e38
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's logits rules (vllm/sampling_params.py): presence and frequency count output tokens
    # only; repetition (CTRL, arXiv:1909.05858) divides positive logits of prompt and output
    # tokens and multiplies negative ones.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    bad_words: list[str] = field(default_factory=list)
    # The constraint the text must follow (JSON schema, regex, choice, grammar); a dict is
    # taken as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # Filled by the engine (`resolve`): the tokens min_tokens holds back (EOS unless ignored,
    # plus stop_token_ids) and each bad word's token ids, with and without a leading space.
    all_stop_token_ids: list[int] = field(default_factory=list, init=False, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()} or None
        self.bad_words = [w for w in (self.bad_words or []) if w.strip()]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as error:  # an unknown field
                raise ValueError(f"invalid structured_outputs: {error}") from None
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value)):
                raise ValueError(
                    f"invalid sampling parameter {name}={value!r}: use a finite number"
                )
            if abs(value) > FLOAT32_MAX:
                raise ValueError(
                    f"invalid sampling parameter {name}={value!r}: the sampler's float32 "
                    f"holds at most {FLOAT32_MAX:.3g}"
                )
        if self.logit_bias and not all(math.isfinite(b) for b in self.logit_bias.values()):
            raise ValueError(
                "invalid sampling parameter logit_bias: every bias must be a finite number"
            )
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if 0 < self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P
        low, high = REPETITION_PENALTY_RANGE
        checks = [
            (1 <= self.n <= 128, "n", self.n, "use a value in [1, 128]"),
            (self.temperature >= 0, "temperature", self.temperature, "use a value >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "use a value in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, "use a positive value, or 0/-1 for off"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "use a value in [0, 1]"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "use a value >= 1",
            ),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "use a value >= 0"),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs",
                self.logprobs,
                "use a value in [0, 20]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                self.prompt_logprobs,
                "use a value in [0, 20]",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                "presence_penalty",
                self.presence_penalty,
                "use a value in [-2, 2]",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                "frequency_penalty",
                self.frequency_penalty,
                "use a value in [-2, 2]",
            ),
            (
                low <= self.repetition_penalty <= high,
                "repetition_penalty",
                self.repetition_penalty,
                f"use a value in [{low:g}, {high:g}] (1 is off)",
            ),
        ]
        for ok, name, value, fix in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={value!r}: {fix}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def has_logits_rules(self) -> bool:
        """Whether the logits change before sampling; plain requests skip that pass."""
        return bool(
            self.has_penalties
            or self.logit_bias
            or self.bad_words_token_ids
            or (self.min_tokens > 0 and self.all_stop_token_ids)
        )

    def for_sample(self, index: int) -> SamplingParams:
        """One of n parallel samples' settings: n=1, and seed + index as vLLM's parallel
        sampling gives each child (vllm/v1/engine/parallel_sampling.py), so the n samples
        differ yet each is reproducible."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    def resolve(
        self, eos_token_ids: tuple[int, ...], encode: Callable[[str], list[int]], vocab_size: int
    ) -> SamplingParams:
        """A copy with what needs the model: stop tokens for min_tokens, bad words' token ids.

        Bad words follow vLLM's rule (SamplingParams.update_from_tokenizer): each word is
        banned as written and, when a leading space makes it a different token sequence of
        the same length, with that space too, so it is caught mid-text as well.
        """
        resolved = replace(self)
        stops = [] if self.ignore_eos else list(eos_token_ids)
        resolved.all_stop_token_ids = sorted(set(stops) | set(self.stop_token_ids))
        for word in self.bad_words:
            plain = encode(word.lstrip())
            resolved.bad_words_token_ids.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                resolved.bad_words_token_ids.append(spaced)
        used = [t for ids in resolved.bad_words_token_ids for t in ids]
        used += list(self.logit_bias or {}) + self.stop_token_ids
        bad = next((t for t in used if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} (in logit_bias, stop_token_ids or bad_words) is out of "
                f"range: ids must lie in [0, {vocab_size})"
            )
        return resolved
