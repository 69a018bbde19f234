"""n parallel samples: the prompt is computed once and its blocks shared; seeds reproduce."""

import pytest

from pipellm import LLM, SamplingParams
from tests.checkpoints import make_tiny_checkpoint

PROMPT = [3 + (i * 11) % 290 for i in range(40)]  # two full 16-token blocks and a tail
PARAMS = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(str(make_tiny_checkpoint(tmp_path_factory.mktemp("m")))) as engine:
        yield engine


def samples(llm, params=PARAMS) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]


def test_seeded_samples_are_reproducible_and_each_is_seed_plus_index(llm):
    first = samples(llm)
    assert len(first) == 4 and len({tuple(s) for s in first}) > 1
    assert samples(llm) == first
    for index, tokens in enumerate(first):
        alone = SamplingParams(temperature=1.0, seed=3 + index, max_tokens=6, ignore_eos=True)
        assert samples(llm, alone) == [tokens]


def test_the_prompt_blocks_are_allocated_once(llm):
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = PROMPT[::-1]  # no earlier test cached it: the samples share by forking alone
    engine.add_request("r", prompt, PARAMS)
    # The first sample's prompt goes alone; the others join the next micro-batch and take its
    # two full prompt blocks (ref count 4), each computing only the 8-token tail.
    engine.step()
    assert [len(r.block_ids) for r in engine.scheduler.running] == [3]
    engine.step()
    running = engine.scheduler.running
    assert len(running) == 4
    shared = running[0].block_ids[:2]
    assert all(r.block_ids[:2] == shared for r in running)
    assert [bm.ref_counts[b] for b in shared] == [4, 4]
    assert bm.num_blocks - bm.num_free_blocks == 2 + 4  # shared prompt blocks + one tail each
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted(o.index for o in outputs if o.finished) == [0, 1, 2, 3]
    assert [o.request_finished for o in outputs].count(True) == 1 and outputs[-1].request_finished
    assert bm.num_free_blocks == bm.num_blocks
