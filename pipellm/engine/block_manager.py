"""Paged KV-cache bookkeeping: which blocks each request owns, plus the prefix cache.

The KV tensors themselves live in the stage workers; this file only hands out block ids.
Prefix caching keys every *full* block by a hash chain over its tokens and all tokens before
it, so two requests sharing a prompt prefix share the blocks. Blocks whose reference count drops
to zero keep their contents and stay findable until they are reused (LRU order).
"""

from __future__ import annotations

from collections import OrderedDict

from pipellm.engine.request import Request


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chains the parent's hash so a block hit implies the whole prefix matches."""
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks in eviction order: the front is reused first (least recently freed).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of a request that owns no blocks yet.

        At least one token is always left to compute: the model must run to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        if request.sampling_params.prompt_logprobs is not None:
            return []  # its prompt's logprobs need every prompt row computed (as vLLM does)
        hashes = self._full_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[int] = []
        for h in hashes[:max_blocks]:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def take_cached_prefix(self, request: Request, cached_blocks: list[int]) -> None:
        """Gives a waiting request the blocks of its cached prefix."""
        assert not request.block_ids, "a request takes its cached prefix only when admitted"
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        request.block_ids = list(cached_blocks)
        request.num_computed_tokens = len(cached_blocks) * self.block_size
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += request.num_computed_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Makes room for `num_new_tokens` more tokens; False (and no change) if blocks run out."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        extra = needed - len(request.block_ids)
        if extra > self.num_free_blocks:
            return False
        for _ in range(max(extra, 0)):
            block, _ = self.free_blocks.popitem(last=False)
            stale = self.block_hash[block]
            if stale is not None:  # evict: its old contents are about to be overwritten
                if self.hash_to_block.get(stale) == block:
                    del self.hash_to_block[stale]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's blocks that `num_tokens` computed tokens fill completely.

        Called when a chunk's micro-batch has passed every stage, so the blocks' KV is written
        everywhere before any other request can be given them. (Stages run micro-batches in
        order, so registering at schedule time would also be safe; at return it stays safe
        whatever a backend does with order, and a hit comes one micro-batch later.)
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._full_block_hashes(request)
        for i in range(min(num_tokens // self.block_size, len(hashes))):
            block = request.block_ids[i]
            if self.block_hash[block] is None and hashes[i] not in self.hash_to_block:
                self.block_hash[block] = hashes[i]
                self.hash_to_block[hashes[i]] = block

    def free(self, request: Request) -> None:
        """Releases a request's blocks; the tail goes first so shared prefixes live longest."""
        for block in reversed(request.block_ids):
            if self.ref_counts[block] == 0:
                # NOTE: a real check, not an assert: under `python -O` a double free would
                # hand one block to two requests, and their KV would silently mix.
                raise RuntimeError(f"block {block} freed twice")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        request.block_ids = []
