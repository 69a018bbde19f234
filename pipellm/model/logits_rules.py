"""vLLM's logits rules, applied before sampling to a micro-batch's rows at once.

The order and formulas are vLLM v1's sampler (vllm/v1/sample/sampler.py): bad words and
min_tokens ban tokens, logit_bias adds to logits, then the penalties of
vllm/model_executor/layers/utils.py apply_penalties: repetition divides positive logits of
tokens seen in the prompt or output and multiplies negative ones; frequency subtracts
penalty x count and presence subtracts penalty once, both over output tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipellm.protocol import SchedulerOutput
from pipellm.sampling_params import SamplingParams


@dataclass
class TokenCounts:
    """One request's output-token counts and prompt-or-output mask, each [vocab]."""

    output_counts: torch.Tensor  # float32, so the frequency penalty is one multiply
    output_present: torch.Tensor  # float32 0/1: output_counts > 0, kept to save a pass
    seen: torch.Tensor  # bool

    @classmethod
    def of(cls, token_ids: list[int], num_output_tokens: int, vocab_size: int) -> TokenCounts:
        tokens = torch.tensor(token_ids, dtype=torch.long)
        outputs = tokens[len(token_ids) - num_output_tokens :]
        counts = torch.bincount(outputs, minlength=vocab_size).to(torch.float32)
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[tokens] = True
        return cls(counts, (counts > 0).float(), seen)

    def add(self, token_ids: list[int]) -> None:
        tokens = torch.tensor(token_ids, dtype=torch.long)
        self.output_counts.index_put_((tokens,), torch.ones(len(token_ids)), accumulate=True)
        self.output_present[tokens] = 1.0
        self.seen[tokens] = True


class OutputTokenCounts:
    """The last stage's TokenCounts of requests with penalties, kept up to date as tokens
    arrive, so a step gathers rows instead of re-counting each request's history."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.requests: dict[str, TokenCounts] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.freed_request_ids:
            self.requests.pop(request_id, None)
        for item in scheduler_output.requests:
            if item.is_new:
                if item.sampling_params.has_penalties:
                    self.requests[item.request_id] = TokenCounts.of(
                        item.new_token_ids, item.num_output_tokens, self.vocab_size
                    )
            elif item.new_token_ids and item.request_id in self.requests:
                # After the first schedule only sampled tokens arrive: they are outputs.
                self.requests[item.request_id].add(item.new_token_ids)


@dataclass
class RowRules:
    """What one sampled row's rules read: its settings, progress and tokens so far."""

    params: SamplingParams
    num_output_tokens: int
    token_ids: list[int]  # prompt then output, the worker's own list (not copied)
    counts: TokenCounts | None = None  # set when the request has penalties


def apply_logits_rules(logits: torch.Tensor, rows: list[RowRules | None]) -> torch.Tensor:
    """logits [S, V] -> the logits to sample from; the same tensor when no row has rules."""
    active = [i for i, row in enumerate(rows) if row is not None and row.params.has_logits_rules]
    if not active:
        return logits
    logits = logits.clone()  # the raw logits stay for logprobs, as vLLM's default reports
    banned: tuple[list[int], list[int]] = ([], [])
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    penalised = []
    for i in active:
        row = rows[i]
        params = row.params
        for word in params.bad_words_token_ids:
            if _ends_with(row, word[:-1]):
                banned[0].append(i)
                banned[1].append(word[-1])
        if row.num_output_tokens < params.min_tokens:
            banned[0].extend([i] * len(params.all_stop_token_ids))
            banned[1].extend(params.all_stop_token_ids)
        for token_id, value in (params.logit_bias or {}).items():
            bias[0].append(i)
            bias[1].append(token_id)
            bias[2].append(value)
        if params.has_penalties:
            penalised.append(i)
    if banned[0]:
        logits[torch.tensor(banned[0]), torch.tensor(banned[1])] = float("-inf")
    if bias[0]:
        # Each (row, token) pair is unique (a dict per row), so a plain gather-add-scatter is
        # exact; index_put_ with accumulate=True takes ~100x longer on CPU.
        index = (torch.tensor(bias[0]), torch.tensor(bias[1]))
        logits[index] += torch.tensor(bias[2])
    if penalised:
        _apply_penalties(logits, penalised, [rows[i] for i in penalised])
    return logits


def _ends_with(row: RowRules, prefix: list[int]) -> bool:
    """Whether the row's output so far ends with `prefix` (vLLM matches output tokens only)."""
    if not prefix:
        return True
    if len(prefix) > row.num_output_tokens:
        return False
    return row.token_ids[len(row.token_ids) - len(prefix) :] == prefix


def _apply_penalties(logits: torch.Tensor, indices: list[int], rows: list[RowRules]) -> None:
    every_row = len(indices) == logits.shape[0]  # then in place: no gather, no scatter back
    index = torch.tensor(indices)
    sub = logits if every_row else logits[index]
    counts = torch.stack([row.counts.output_counts for row in rows])
    seen = torch.stack([row.counts.seen for row in rows])

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(row.params, name) for row in rows]).unsqueeze(1)

    # Terms every row leaves at its neutral value are skipped: each is a pass over [R, V].
    if any(row.params.repetition_penalty != 1.0 for row in rows):
        # Only the few seen tokens change: gather them, rather than passes over [R, V].
        repetition = column("repetition_penalty").squeeze(1).repeat_interleave(seen.sum(1))
        values = sub[seen]
        sub[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if any(row.params.frequency_penalty != 0.0 for row in rows):
        sub.addcmul_(counts, column("frequency_penalty"), value=-1.0)
    if any(row.params.presence_penalty != 0.0 for row in rows):
        present = torch.stack([row.counts.output_present for row in rows])
        sub.addcmul_(present, column("presence_penalty"), value=-1.0)
    if not every_row:
        logits[index] = sub
