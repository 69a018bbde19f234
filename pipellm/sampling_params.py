"""Per-request sampling settings, validated on construction (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n == 1, "n", self.n, "only n=1 is supported; send several requests instead"),
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
        ]
        for ok, name, value, fix in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={value!r}: {fix}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
