"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs`) on the last stage.

They come from the same forward as the prompt: row p of a prompt chunk predicts prompt token
p + 1, so every chunk (chunked prefill, any pipeline stage count) gives the logprobs of the
prompt tokens after its rows, and the first prompt token has none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipellm.model.forward_batch import ForwardBatch
from pipellm.protocol import Logprobs, SchedulerOutput
from pipellm.worker.input_builder import RequestState

ROWS_PER_SLICE = 128  # bounds the [rows, vocab] logits held at once for long prompt chunks


def prompt_logprobs(
    scheduler_output: SchedulerOutput,
    batch: ForwardBatch,
    hidden: torch.Tensor,
    states: dict[str, RequestState],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, tuple[int, list[Logprobs]]] | None:
    """request id -> (first prompt position covered, entries) for this step's prompt chunks."""
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    spans: list[tuple[str, int, int]] = []  # (request id, first position, count)
    for item, last_row in zip(scheduler_output.requests, batch.last_rows, strict=True):
        state = states[item.request_id]
        k = state.sampling_params.prompt_logprobs
        if k is None or item.num_output_tokens > 0:  # resumed after its prompt was reported
            continue
        start = item.num_computed_tokens
        end = min(start + item.num_scheduled_tokens, len(state.token_ids) - 1)
        if end <= start:
            continue
        first_row = last_row - (item.num_scheduled_tokens - 1)
        rows += range(first_row, first_row + end - start)
        targets += state.token_ids[start + 1 : end + 1]
        ks += [k] * (end - start)
        spans.append((item.request_id, start + 1, end - start))
    if not rows:
        return None
    entries: list[Logprobs] = []
    for at in range(0, len(rows), ROWS_PER_SLICE):
        chunk = slice(at, at + ROWS_PER_SLICE)
        logits = compute_logits(hidden[torch.tensor(rows[chunk])])
        entries += logprob_entries(logits.log_softmax(-1), targets[chunk], ks[chunk])
    result = {}
    at = 0
    for request_id, position, count in spans:
        result[request_id] = (position, entries[at : at + count])
        at += count
    return result


def logprob_entries(logprobs: torch.Tensor, tokens: list[int], ks: list[int]) -> list[Logprobs]:
    """Per row of logprobs [N, V]: (the token's logprob, its k most likely (token, logprob))."""
    chosen = logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    top_k = max(ks)
    top = logprobs.topk(top_k) if top_k else None
    out = []
    for row, (logprob, k) in enumerate(zip(chosen, ks, strict=True)):
        pairs = []
        if k:
            ids, values = top.indices[row, :k].tolist(), top.values[row, :k].tolist()
            pairs = list(zip(ids, values, strict=True))
        out.append((logprob, pairs))
    return out
