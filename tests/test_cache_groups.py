"""KV-cache groups: sliding-window layers give back the blocks out of their window, and the
budget split between groups (model/cache_groups.py, engine/block_manager.py)."""

from pipellm.engine.block_manager import BlockManager
from pipellm.engine.request import Request
from pipellm.model.cache_groups import NULL_BLOCK, CacheGroup, sequence_blocks, split_cache
from pipellm.sampling_params import SamplingParams

BS = 16
WINDOW = 512


def gemma_like(full_blocks: int, window_blocks: int, prefix_caching: bool = False) -> BlockManager:
    """Gemma 3's pattern: five local layers (window 512) for each global one."""
    groups = [CacheGroup(0, 1, full_blocks), CacheGroup(WINDOW, 5, window_blocks)]
    return BlockManager(0, BS, prefix_caching, groups)


def compute(bm: BlockManager, request: Request, num_tokens: int) -> None:
    """Schedules `num_tokens` more of the request's tokens, as the scheduler does."""
    assert bm.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    bm.cache_full_blocks(request, request.num_computed_tokens)


def decode(bm: BlockManager, request: Request) -> None:
    request.append_output_token(request.num_tokens % 1000)
    compute(bm, request, 1)


def in_window_blocks(next_position: int) -> int:
    """Blocks covering positions [next_position - WINDOW + 1, next_position]."""
    return next_position // BS - max(0, next_position - WINDOW + 1) // BS + 1


def test_kv_bytes_at_8192_tokens_follow_the_window_not_the_context():
    bm = gemma_like(full_blocks=600, window_blocks=200)
    request = Request("a", list(range(8192)), SamplingParams())
    for _ in range(4):
        compute(bm, request, 2048)  # chunked prefill
    decode(bm, request)  # the token after 8,192 of context, at position 8192
    full, window = bm.num_held_blocks(0), bm.num_held_blocks(1)
    assert full == 8192 // BS + 1 == 513
    assert window == in_window_blocks(8192) == 33
    assert sum(b != NULL_BLOCK for b in request.block_tables[1]) == window
    # Bytes (layer-blocks) against a cache that keeps every block for all six layers.
    ratio = (1 * full + 5 * window) / (6 * full)
    expected = (5 * WINDOW + 8192) / (6 * 8192)
    assert abs(ratio - expected) / expected < 0.01
    bm.free(request)
    assert bm.num_held_blocks(0) == bm.num_held_blocks(1) == 0


def test_window_blocks_are_given_back_as_decode_advances():
    bm = gemma_like(full_blocks=200, window_blocks=40)  # 39 usable: ~1.2 windows
    request = Request("a", list(range(600)), SamplingParams())
    compute(bm, request, 600)
    held_after_prompt = bm.num_held_blocks(1)
    assert held_after_prompt == 600 // BS + 1  # the prompt's chunk wrote all of them
    for _ in range(1500):  # 2,100 tokens would need 132 blocks without giving back
        decode(bm, request)
        assert bm.num_held_blocks(1) == in_window_blocks(request.num_computed_tokens - 1)
    assert bm.num_held_blocks(0) == -(-request.num_computed_tokens // BS)
    bm.free(request)
    assert bm.num_held_blocks(1) == 0 and len(bm.pools[1].free_blocks) == 39


def test_prefix_hit_needs_only_the_window_blocks_and_shortens_when_they_are_evicted():
    bs, window = 4, 8
    groups = [CacheGroup(0, 1, 16), CacheGroup(window, 1, 7)]  # window pool: null + 6
    bm = BlockManager(0, bs, True, groups)
    a = Request("a", list(range(24)), SamplingParams())
    compute(bm, a, 24)  # 6 full blocks, registered in both groups
    bm.free(a)  # the tail is freed first, so it is evicted first
    d = Request("d", [99] * 8, SamplingParams())
    assert bm.allocate_slots(d, 8)  # evicts a's last two window blocks, no full ones
    b = Request("b", list(range(24)) + [5], SamplingParams())
    full, win = bm.find_cached_prefix(b)
    # 6 blocks: the window from position 24 reaches blocks 4-5 (evicted); 5: blocks 3-4;
    # 4: blocks 2-3, both cached.
    assert len(full) == len(win) == 4
    assert win[:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in win[2:]
    assert not bm.can_admit([full, win], 9)  # blocks 2-6 of the window pool: d holds two
    bm.free(d)
    assert bm.can_admit([full, win], 9)
    bm.take_cached_prefix(b, [full, win])
    assert b.num_computed_tokens == 16
    assert bm.allocate_slots(b, 9)
    assert bm.num_held_blocks(1) == 5
    bm.free(b)
    assert bm.num_held_blocks(0) == bm.num_held_blocks(1) == 0


def test_a_parallel_sample_shares_the_prompt_only_while_the_window_is_held():
    bm = BlockManager(0, 4, True, [CacheGroup(0, 1, 32), CacheGroup(8, 1, 32)])
    first = Request("a", list(range(20)), SamplingParams())
    compute(bm, first, 20)
    shared = bm.shared_prefix(first, 4)  # the sample computes from position 16
    assert shared is not None and shared[0] == first.block_tables[0][:4]
    assert shared[1][:2] == [NULL_BLOCK] * 2 and shared[1][2:] == first.block_tables[1][2:4]
    for _ in range(12):  # the first sample moves on: its window leaves blocks 2-3
        decode(bm, first)
    assert bm.shared_prefix(first, 4) is None


def test_split_holds_as_many_long_sequences_in_each_group():
    budget = 10_000  # blocks of all 6 layers
    full, window = split_cache(budget, {0: 1, WINDOW: 5}, BS, 8192, 2048)
    assert full.num_layers == 1 and window.num_layers == 5
    assert full.num_blocks + 5 * window.num_blocks <= 6 * budget
    long_sequences = full.num_blocks // sequence_blocks(0, BS, 8192)
    headroom = sequence_blocks(WINDOW, BS, 8192, 2048) - sequence_blocks(WINDOW, BS, 8192) + 1
    per_window = sequence_blocks(WINDOW, BS, 8192)
    assert (window.num_blocks - headroom) // per_window == long_sequences
    # Without windows: ~6 x 10,000 / 6 / 512 = 19 sequences; with them about 4.5x that.
    assert long_sequences >= 4 * (budget // 512)
    (only,) = split_cache(budget, {0: 30}, BS, 8192, 2048)
    assert only == CacheGroup(0, 30, budget)


def test_each_stage_plans_its_layers_groups(tmp_path):
    """Tiny Gemma 3, two stages: the first has only local layers (no full-attention pool), the
    second two local and the global one; together they hold the split budget."""
    from pipellm.config import EngineConfig
    from pipellm.worker.stage_memory import kv_cache_bytes
    from tests.checkpoints import make_tiny_checkpoint

    directory = make_tiny_checkpoint(tmp_path / "gemma3", arch="gemma3")
    config = EngineConfig(
        model=str(directory), pipeline_parallel_size=2, kv_cache_memory=4 << 20, max_model_len=512
    )
    full, window = config.kv_cache_groups
    assert (full.num_layers, window.num_layers) == (1, 5)
    layer_block = config.kv_bytes_per_block // 6  # one layer's keys and values of one block
    assert kv_cache_bytes(config, 0) == 3 * window.num_blocks * layer_block
    assert kv_cache_bytes(config, 1) == (2 * window.num_blocks + full.num_blocks) * layer_block
    assert kv_cache_bytes(config, 0) + kv_cache_bytes(config, 1) <= 4 << 20
    assert full.num_blocks >= 512 // 16 and window.num_blocks < full.num_blocks
