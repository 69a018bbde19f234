"""Keeps each request's tokens and blocks on a stage, and turns a SchedulerOutput into tensors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pipellm.model.forward_batch import ForwardBatch, PrefillChunk
from pipellm.protocol import ScheduledRequest, SchedulerOutput
from pipellm.sampling_params import SamplingParams


@dataclass
class RequestState:
    token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams
    # The other KV-cache groups' tables (sliding-window layers): each indexed by position
    # like block_ids, NULL_BLOCK (or a block given back since) where the window no longer
    # reaches: attention never reads those positions, or reads them masked.
    group_block_ids: list[list[int]] = field(default_factory=list)


class InputBuilder:
    """A stage's view of its requests (tokens, KV blocks, sampling settings), kept in step with the
    scheduler's, and the tensors of each step built from it; the model runs in StageWorker."""

    def __init__(self, block_size: int, num_cache_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_cache_groups = num_cache_groups
        self.requests: dict[str, RequestState] = {}

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Applies what changed since the last step: freed, new and continuing requests."""
        for request_id in scheduler_output.freed_request_ids:
            self.requests.pop(request_id, None)
        for item in scheduler_output.requests:
            if item.is_new:
                self.requests[item.request_id] = RequestState(
                    list(item.new_token_ids),
                    list(item.new_block_ids),
                    item.sampling_params,
                    [list(blocks) for blocks in item.new_group_block_ids],
                )
            else:
                state = self.requests[item.request_id]
                state.token_ids.extend(item.new_token_ids)
                state.block_ids.extend(item.new_block_ids)
                groups = zip(state.group_block_ids, item.new_group_block_ids, strict=True)
                for table, blocks in groups:
                    table.extend(blocks)

    def prepare(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        """Returns (input token ids, batch). Single-token chunks (decodes) come first so they
        share one attention call; `logits_indices` keeps the scheduler's order.

        Everything goes into Python lists, turned into tensors once at the end: ~0.15 ms for
        16 decodes, where per-request tensor ops cost several times that.
        """
        items = scheduler_output.requests
        decodes = [i for i, item in enumerate(items) if item.num_scheduled_tokens == 1]
        order = decodes + [i for i, item in enumerate(items) if item.num_scheduled_tokens != 1]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[PrefillChunk] = []
        last_row = [0] * len(items)
        for i in order:
            item = items[i]
            state = self.requests[item.request_id]
            start = item.num_computed_tokens
            end = start + item.num_scheduled_tokens
            blocks = state.block_ids
            if item.num_scheduled_tokens > 1:
                prefills.append(self._prefill_chunk(blocks, len(input_ids), start, end))
            input_ids += state.token_ids[start:end]
            positions += range(start, end)
            slot_mapping += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            last_row[i] = len(input_ids) - 1
        tables, context_lens, mask = self._decode_inputs([items[i] for i in decodes])
        batch = ForwardBatch(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slot_mapping),
            num_decodes=len(decodes),
            decode_block_tables=tables,
            decode_context_lens=context_lens,
            decode_mask=mask,
            prefills=prefills,
            logits_indices=torch.tensor(
                [last_row[i] for i, it in enumerate(items) if it.sample], dtype=torch.long
            ),
            last_rows=last_row,
        )
        batch.group_batches = [
            self._group_batch(batch, scheduler_output, order, decodes, g)
            for g in range(self.num_cache_groups - 1)
        ]
        return torch.tensor(input_ids), batch

    def _group_batch(
        self,
        batch: ForwardBatch,
        scheduler_output: SchedulerOutput,
        order: list[int],
        decodes: list[int],
        group: int,
    ) -> ForwardBatch:
        """`batch` with the cache slots and block tables of KV-cache group `group` + 1."""
        items = scheduler_output.requests
        bs = self.block_size
        slot_mapping: list[int] = []
        prefills = iter(batch.prefills)
        chunks = []
        for i in order:
            item = items[i]
            blocks = self.requests[item.request_id].group_block_ids[group]
            start = item.num_computed_tokens
            end = start + item.num_scheduled_tokens
            slot_mapping += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            if item.num_scheduled_tokens > 1:
                chunk = next(prefills)
                if chunk.block_table is not None:
                    table = torch.tensor(blocks[: len(chunk.block_table)])
                    chunk = replace(chunk, block_table=table)
                chunks.append(chunk)
        tables = batch.decode_block_tables
        if tables is not None:
            tables = torch.tensor(
                [
                    self._padded(
                        self.requests[items[i].request_id].group_block_ids[group],
                        tables.shape[1],
                    )
                    for i in decodes
                ]
            )
        return replace(
            batch,
            slot_mapping=torch.tensor(slot_mapping),
            decode_block_tables=tables,
            prefills=chunks,
            group_batches=[],
        )

    @staticmethod
    def _padded(blocks: list[int], length: int) -> list[int]:
        blocks = blocks[:length]
        return blocks + [0] * (length - len(blocks))

    def _prefill_chunk(self, blocks: list[int], row: int, start: int, end: int) -> PrefillChunk:
        if start == 0:
            return PrefillChunk(row, end, None, None)
        num_blocks = -(-end // self.block_size)
        mask = torch.arange(end) <= torch.arange(start, end).unsqueeze(1)
        return PrefillChunk(row, end - start, torch.tensor(blocks[:num_blocks]), mask)

    def _decode_inputs(
        self, decodes: list[ScheduledRequest]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Block tables padded with block 0 to the longest context, the context lengths, and
        the mask hiding the padding (and each row's slots past its own context)."""
        if not decodes:
            return None, None, None
        context_lens = [d.num_computed_tokens + 1 for d in decodes]
        max_blocks = -(-max(context_lens) // self.block_size)
        tables = [self._padded(self.requests[d.request_id].block_ids, max_blocks) for d in decodes]
        lens = torch.tensor(context_lens)
        mask = torch.arange(max_blocks * self.block_size) < lens.unsqueeze(1)
        return torch.tensor(tables), lens, mask.view(len(decodes), 1, 1, -1)
