"""Keeps each request's tokens and blocks on a stage, and turns a SchedulerOutput into tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipellm.engine.scheduler_output import SchedulerOutput
from pipellm.model.forward_batch import ForwardBatch, PrefillChunk
from pipellm.sampling_params import SamplingParams


@dataclass
class RequestState:
    token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams


class ModelRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[str, RequestState] = {}

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Applies what changed since the last step: freed, new and continuing requests."""
        for request_id in scheduler_output.freed_request_ids:
            self.requests.pop(request_id, None)
        for item in scheduler_output.requests:
            if item.is_new:
                self.requests[item.request_id] = RequestState(
                    list(item.new_token_ids), list(item.new_block_ids), item.sampling_params
                )
            else:
                state = self.requests[item.request_id]
                state.token_ids.extend(item.new_token_ids)
                state.block_ids.extend(item.new_block_ids)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def prepare(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        """Returns (input token ids, batch). Single-token chunks (decodes) come first so they
        share one attention call; `logits_indices` keeps the scheduler's order."""
        items = scheduler_output.requests
        order = sorted(range(len(items)), key=lambda i: items[i].num_scheduled_tokens != 1)
        num_decodes = sum(items[i].num_scheduled_tokens == 1 for i in order)
        input_ids, positions, slot_mapping, prefills = [], [], [], []
        last_row = {}
        row = 0
        for i in order:
            item = items[i]
            state = self.requests[item.request_id]
            start, end = (
                item.num_computed_tokens,
                item.num_computed_tokens + item.num_scheduled_tokens,
            )
            input_ids.extend(state.token_ids[start:end])
            positions.append(torch.arange(start, end))
            slot_mapping.append(self._slots(state.block_ids, start, end))
            if item.num_scheduled_tokens > 1:
                prefills.append(self._prefill_chunk(state, row, start, end))
            row += item.num_scheduled_tokens
            last_row[i] = row - 1
        decode_slots, decode_mask = self._decode_inputs([items[i] for i in order[:num_decodes]])
        batch = ForwardBatch(
            positions=torch.cat(positions),
            slot_mapping=torch.cat(slot_mapping),
            num_decodes=num_decodes,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
            logits_indices=torch.tensor(
                [last_row[i] for i in range(len(items)) if items[i].sample]
            ),
        )
        return torch.tensor(input_ids, dtype=torch.long), batch

    def _prefill_chunk(self, state: RequestState, row: int, start: int, end: int) -> PrefillChunk:
        if start == 0:
            return PrefillChunk(row, end - start, 0, None, None)
        query_positions = torch.arange(start, end).unsqueeze(1)
        mask = torch.arange(end).unsqueeze(0) <= query_positions
        return PrefillChunk(row, end - start, start, self._slots(state.block_ids, 0, end), mask)

    def _decode_inputs(self, decodes) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not decodes:
            return None, None
        context_lens = torch.tensor([d.num_computed_tokens + 1 for d in decodes])
        max_len = int(context_lens.max())
        num_blocks = -(-max_len // self.block_size)
        table = torch.zeros(len(decodes), num_blocks, dtype=torch.long)
        for row, d in enumerate(decodes):
            blocks = self.requests[d.request_id].block_ids[:num_blocks]
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        offsets = torch.arange(self.block_size)
        slots = (table.unsqueeze(-1) * self.block_size + offsets).view(len(decodes), -1)
        slots = slots[:, :max_len]
        mask = torch.arange(max_len).unsqueeze(0) < context_lens.unsqueeze(1)
        return slots, mask.view(len(decodes), 1, 1, max_len)
