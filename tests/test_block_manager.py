"""Block manager: allocation, prefix hits, LRU eviction and leak-freedom."""

import pytest

from pipellm.engine.block_manager import BlockManager
from pipellm.engine.request import Request
from pipellm.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def admit(bm: BlockManager, request: Request) -> None:
    """Admits a request the way the scheduler does: cached prefix, then fresh blocks."""
    cached = bm.find_cached_prefix(request)
    bm.take_cached_prefix(request, cached)
    assert bm.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request, request.num_tokens)


def test_allocation_counts_blocks_and_frees_everything():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    request = make_request("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert bm.allocate_slots(request, 9)
    assert len(request.block_ids) == 3 and bm.num_free_blocks == 7
    request.num_computed_tokens = 9
    assert bm.allocate_slots(request, 3)  # 12 tokens still fit in 3 blocks
    assert len(request.block_ids) == 3
    assert bm.allocate_slots(request, 4)  # 13 tokens need a 4th
    assert len(request.block_ids) == 4
    bm.free(request)
    assert bm.num_free_blocks == 10 and request.block_ids == []
    assert all(count == 0 for count in bm.ref_counts)


def test_allocation_fails_without_changes_when_blocks_run_out():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    request = make_request("a", list(range(12)))
    assert not bm.allocate_slots(request, 12)
    assert request.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    admit(bm, first)
    second = make_request("b", list(range(8)) + [99, 98, 97])
    cached = bm.find_cached_prefix(second)
    assert cached == [first.block_ids[:2]]
    bm.take_cached_prefix(second, cached)
    assert second.num_computed_tokens == 8
    assert bm.ref_counts[cached[0][0]] == 2
    # An identical prompt that is all full blocks still computes its last block.
    third = make_request("c", list(range(8)))
    assert bm.find_cached_prefix(third) == [first.block_ids[:1]]


def test_different_prefix_misses_even_with_equal_later_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # block 2 equal, block 1 not
    assert bm.find_cached_prefix(other) == [[]]


def test_freed_cached_blocks_stay_findable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])  # 3 blocks, 2 full
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = make_request("a2", [1, 2, 3, 4, 5])
    assert len(bm.find_cached_prefix(again)[0]) == 2
    # Filling the cache with other tokens evicts the old blocks, least recently freed first.
    b = make_request("b", [7, 7, 8, 8, 9, 9, 6])  # needs all 4 blocks
    admit(bm, b)
    assert bm.find_cached_prefix(make_request("a3", [1, 2, 3, 4, 5])) == [[]]
    bm.free(b)
    assert bm.num_free_blocks == 4


def test_lru_evicts_the_tail_of_a_freed_prefix_first():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    head, middle = a.block_ids[0], a.block_ids[1]
    bm.free(a)
    b = make_request("b", [9, 9, 9])  # 2 blocks: the untouched free block, then a's tail
    admit(bm, b)
    assert head not in b.block_ids and middle not in b.block_ids
    assert bm.find_cached_prefix(make_request("c", [1, 2, 3, 4, 0])) == [[head, middle]]


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    request = make_request("a", [1, 2, 3])
    assert bm.allocate_slots(request, 3)
    blocks = list(request.block_ids)
    bm.free(request)
    request.block_ids = blocks
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(request)
