"""KV-cache groups: layers that keep the same blocks, and the cache budget split between them.

Full-attention layers need every block of a sequence; a sliding-window layer only the blocks
its window still reaches. As in vLLM's hybrid KV cache manager (docs: "Hybrid KV Cache
Manager"), the layers are grouped by window, each group has its own blocks and its own block
table per sequence, and a window group gives back the blocks that fell out of its window as
the sequence advances. Unlike vLLM, whose groups share one pool of equal-sized pages, each
group here has its own pool, sized from the budget below; a model without windows has one
group, the cache it had before.
"""

from __future__ import annotations

from dataclasses import dataclass

# A window group's table entry for a block it gave back: its pool's block 0, never handed out
# nor written, which the kernels never read (the window skips it) or read masked.
NULL_BLOCK = 0


@dataclass(frozen=True)
class CacheGroup:
    window: int  # 0: full attention
    num_layers: int  # the model's layers in this group (over all pipeline stages)
    num_blocks: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def window_blocks(window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """The most blocks a window layer holds for one sequence while it computes
    `num_new_tokens` tokens: the window before the first of them, then the new ones."""
    return blocks_for(window - 1 + num_new_tokens, block_size) + 1


def sequence_blocks(window: int, block_size: int, num_tokens: int, chunk: int = 1) -> int:
    """Blocks one sequence of `num_tokens` tokens holds in a group computing `chunk` at once."""
    full = blocks_for(num_tokens, block_size)
    return full if window == 0 else min(full, window_blocks(window, block_size, chunk))


def split_cache(
    budget_blocks: int,
    layers_by_window: dict[int, int],
    block_size: int,
    max_model_len: int,
    max_chunk: int,
) -> list[CacheGroup]:
    """The groups (full attention first) and their pool sizes for a budget of `budget_blocks`
    blocks of every layer (the cache without windows).

    Every group holds the same number of max_model_len sequences, so no group runs out first
    for long sequences, and each window group gets on top the extra blocks one prompt chunk of
    `max_chunk` tokens needs (its window plus the chunk), so a long prompt always fits, and
    its null block (NULL_BLOCK). With one group this is `budget_blocks`, as without groups.
    """
    windows = sorted(layers_by_window)
    if len(windows) == 1:
        return [CacheGroup(windows[0], layers_by_window[windows[0]], budget_blocks)]
    total_layers = sum(layers_by_window.values())
    per_seq = {w: sequence_blocks(w, block_size, max_model_len) for w in windows}
    headroom = {
        w: sequence_blocks(w, block_size, max_model_len, max_chunk) - per_seq[w] + (w > 0)
        for w in windows
    }
    # In layer-blocks: budget = sum_w layers_w * (k * per_seq_w + headroom_w).
    layer_blocks = budget_blocks * total_layers
    fixed = sum(layers_by_window[w] * headroom[w] for w in windows)
    per_sequence = sum(layers_by_window[w] * per_seq[w] for w in windows)
    sequences = max(0.0, (layer_blocks - fixed) / per_sequence)
    return [
        CacheGroup(w, layers_by_window[w], int(sequences * per_seq[w]) + headroom[w])
        for w in windows
    ]


def min_budget_blocks(
    layers_by_window: dict[int, int], block_size: int, max_model_len: int, max_chunk: int
) -> int:
    """The fewest no-window blocks whose split holds one max_model_len sequence in every group."""
    total_layers = sum(layers_by_window.values())
    layer_blocks = sum(
        layers * (sequence_blocks(w, block_size, max_model_len, max_chunk) + (w > 0))
        for w, layers in layers_by_window.items()
    )
    return -(-layer_blocks // total_layers)
