"""Paged KV-cache bookkeeping: which blocks each request owns, plus the prefix cache.

The KV tensors themselves live in the stage workers; this file only hands out block ids, one
pool and one block table per request for each KV-cache group (model/cache_groups.py): the
full-attention layers, and the sliding-window layers of each window. A window group gives back
a request's blocks that fell out of its window (whose every position is older than `window`
before the next token to compute) whenever the request is allocated more, and its table holds
NULL_BLOCK in their place, so every group's table stays indexed by position.

Prefix caching keys every *full* block by a hash chain over its tokens and all tokens before
it, so two requests sharing a prompt prefix share the blocks. Blocks whose reference count drops
to zero keep their contents and stay findable until they are reused (LRU order). A prefix of
k blocks is a hit when every group holds what it needs of it: a full-attention group all k
blocks, a window group the blocks its window reaches from the token after the prefix (as
vLLM's sliding-window manager finds hits); the window group's older entries are NULL_BLOCK.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pipellm.engine.request import Request
from pipellm.model.cache_groups import NULL_BLOCK, CacheGroup


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chains the parent's hash so a block hit implies the whole prefix matches."""
    return hash((parent_hash, token_ids))


class BlockPool:
    """One group's blocks: reference counts, the free list in eviction order, the hashes."""

    def __init__(self, num_blocks: int, reserve_null: bool) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks in eviction order: the front is reused first (least recently freed).
        first = NULL_BLOCK + 1 if reserve_null else 0
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))
        self.num_usable = len(self.free_blocks)

    def take(self, block: int) -> None:
        """One more holder of a block (a prefix-cache hit or a shared fork)."""
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def pop_free(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        stale = self.block_hash[block]
        if stale is not None:  # evict: its old contents are about to be overwritten
            if self.hash_to_block.get(stale) == block:
                del self.hash_to_block[stale]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def release(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            # NOTE: a real check, not an assert: under `python -O` a double free would
            # hand one block to two requests, and their KV would silently mix.
            raise RuntimeError(f"block {block} freed twice")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def register(self, block: int, block_hash: int) -> None:
        if self.block_hash[block] is None and block_hash not in self.hash_to_block:
            self.block_hash[block] = block_hash
            self.hash_to_block[block_hash] = block


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        groups: Sequence[CacheGroup] | None = None,
    ) -> None:
        """`groups`: the KV-cache groups, full attention first (`num_blocks` is then unused);
        None: one full-attention group of `num_blocks` blocks."""
        if groups is None:
            groups = [CacheGroup(0, 1, num_blocks)]
        if any(g.num_blocks - (g.window > 0) <= 0 for g in groups):
            raise ValueError("the KV cache needs at least one block")
        self.groups = list(groups)
        self.windows = [g.window for g in groups]
        self.pools = [BlockPool(g.num_blocks, g.window > 0) for g in groups]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    # The first group's pool, as one-group code and tests read it.
    @property
    def num_blocks(self) -> int:
        return self.pools[0].num_usable

    @property
    def num_free_blocks(self) -> int:
        return len(self.pools[0].free_blocks)

    @property
    def ref_counts(self) -> list[int]:
        return self.pools[0].ref_counts

    @property
    def usage(self) -> float:
        """Fraction of the cache's bytes held by requests (cached-but-free blocks count as
        free): each group's blocks weigh as many layers as it has."""
        held = total = 0
        for group, pool in zip(self.groups, self.pools, strict=True):
            held += group.num_layers * (pool.num_usable - len(pool.free_blocks))
            total += group.num_layers * pool.num_usable
        return held / total

    def num_held_blocks(self, group: int) -> int:
        pool = self.pools[group]
        return pool.num_usable - len(pool.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, group: int, next_position: int) -> int:
        """The oldest block a group's layers still read when the next token to compute is at
        `next_position`: 0 for full attention."""
        window = self.windows[group]
        return max(0, next_position - window + 1) // self.block_size if window else 0

    def _full_block_hashes(self, request: Request) -> list[int]:
        """Extends the request's hash chain over all of its currently full blocks."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(request.all_token_ids[i * bs : (i + 1) * bs])))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[list[int]]:
        """Per group, the block table of the longest cached prefix of a request that owns no
        blocks yet (window groups: NULL_BLOCK before what their window reaches).

        At least one token is always left to compute: the model must run to produce logits.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt row computed (as vLLM does).
            return [[] for _ in self.pools]
        hashes = self._full_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        # found[g][i]: group g's cached block for block i, or None; a full group stops at a miss.
        found: list[list[int | None]] = []
        limit = max_blocks
        for window, pool in zip(self.windows, self.pools, strict=True):
            blocks = [pool.hash_to_block.get(h) for h in hashes[:limit]]
            if not window and None in blocks:
                limit = blocks.index(None)
                blocks = blocks[:limit]
            found.append(blocks)
        window_groups = [g for g, window in enumerate(self.windows) if window]
        for num_blocks in range(limit, 0, -1):
            position = num_blocks * self.block_size
            if all(
                None not in found[g][self.first_needed_block(g, position) : num_blocks]
                for g in window_groups
            ):
                return [self._prefix_table(g, found[g], num_blocks) for g in range(len(found))]
        return [[] for _ in self.pools]

    def _prefix_table(self, group: int, blocks: list[int | None], num_blocks: int) -> list[int]:
        first = self.first_needed_block(group, num_blocks * self.block_size)
        return [NULL_BLOCK] * first + blocks[first:num_blocks]

    def shared_prefix(self, source: Request, num_blocks: int) -> list[list[int]] | None:
        """Per group, the first `num_blocks` of `source`'s tables for a request to share from
        the token after them on; None if a window group gave back one it would need."""
        tables = []
        for g, table in enumerate(source.block_tables):
            first = self.first_needed_block(g, num_blocks * self.block_size)
            needed = table[first:num_blocks]
            if self.windows[g] and NULL_BLOCK in needed:
                return None
            tables.append([NULL_BLOCK] * first + needed)
        return tables

    def can_admit(self, cached: list[list[int]], num_new_tokens: int) -> bool:
        """Whether every group has the blocks to admit a request with this cached prefix and
        `num_new_tokens` to compute after it."""
        num_cached_tokens = len(cached[0]) * self.block_size
        needed = self.blocks_needed(num_cached_tokens + num_new_tokens)
        for g, pool in enumerate(self.pools):
            newly_taken = sum(
                pool.ref_counts[b] == 0 for b in cached[g] if b != NULL_BLOCK or not self.windows[g]
            )
            if newly_taken + needed - len(cached[g]) > len(pool.free_blocks):
                return False
        return True

    def take_cached_prefix(self, request: Request, cached: list[list[int]]) -> None:
        """Gives a waiting request the blocks of its cached prefix."""
        assert not request.block_ids, "a request takes its cached prefix only when admitted"
        for g, (pool, table) in enumerate(zip(self.pools, cached, strict=True)):
            for block in table:
                if block != NULL_BLOCK or not self.windows[g]:
                    pool.take(block)
        request.block_tables = [list(table) for table in cached]
        request.num_computed_tokens = len(cached[0]) * self.block_size
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += request.num_computed_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Makes room for `num_new_tokens` more tokens after the computed ones, first giving
        back what fell out of each window; False (and no new block) if blocks run out."""
        if not request.block_tables:
            request.block_tables = [[] for _ in self.pools]
        self._release_out_of_window(request)
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        for pool, table in zip(self.pools, request.block_tables, strict=True):
            if needed - len(table) > len(pool.free_blocks):
                return False
        for pool, table in zip(self.pools, request.block_tables, strict=True):
            for _ in range(needed - len(table)):
                table.append(pool.pop_free())
        return True

    def _release_out_of_window(self, request: Request) -> None:
        """Gives back each window group's blocks the request's next token no longer reaches.

        Safe while earlier chunks of the request are in flight: a block given back now can be
        written only by a later micro-batch, and every stage runs micro-batches in order, so
        those chunks have read it on a stage before anything overwrites it there.
        """
        for g, window in enumerate(self.windows):
            if not window:
                continue
            table, pool = request.block_tables[g], self.pools[g]
            i = min(self.first_needed_block(g, request.num_computed_tokens), len(table)) - 1
            while i >= 0 and table[i] != NULL_BLOCK:
                pool.release(table[i])
                table[i] = NULL_BLOCK
                i -= 1

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's blocks that `num_tokens` computed tokens fill completely
        (a window group's still held ones).

        Called when a chunk's micro-batch has passed every stage, so the blocks' KV is written
        everywhere before any other request can be given them. (Stages run micro-batches in
        order, so registering at schedule time would also be safe; at return it stays safe
        whatever a backend does with order, and a hit comes one micro-batch later.)
        """
        if not self.enable_prefix_caching or not request.block_tables:
            return
        hashes = self._full_block_hashes(request)
        num_full = num_tokens // self.block_size
        for g, (pool, table) in enumerate(zip(self.pools, request.block_tables, strict=True)):
            window = self.windows[g]
            for i in range(min(num_full, len(hashes), len(table))):
                if window and table[i] == NULL_BLOCK:
                    continue
                pool.register(table[i], hashes[i])

    def free(self, request: Request) -> None:
        """Releases a request's blocks; the tail goes first so shared prefixes live longest."""
        # A request never given blocks has no tables.
        for g, (pool, table) in enumerate(zip(self.pools, request.block_tables, strict=False)):
            for block in reversed(table):
                if block != NULL_BLOCK or not self.windows[g]:
                    pool.release(block)
        request.block_tables = []
