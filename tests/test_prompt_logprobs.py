"""Prompt logprobs equal transformers' log-softmax, whatever the chunking and stage count."""

import pytest
import torch
import transformers

from pipellm import LLM, SamplingParams
from tests.checkpoints import make_tiny_checkpoint

PROMPTS = [[3 + (i * 13) % 290 for i in range(40)], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
TOP = 3


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("m"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        expected = [model(torch.tensor([p])).logits[0].log_softmax(-1) for p in PROMPTS]
    return directory, expected


def check(outputs, expected) -> None:
    for output, prompt, logprobs in zip(outputs, PROMPTS, expected, strict=True):
        got = output.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for position in range(1, len(prompt)):
            logprob, top = got[position]
            row = logprobs[position - 1]
            assert logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
            want = row.topk(TOP)
            assert [t for t, _ in top] == want.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("stages", [1, 2])
def test_prompt_logprobs_match_transformers(case, stages):
    directory, expected = case
    # A 16-token budget splits the 40-token prompt into chunks over several micro-batches.
    engine_args = dict(
        pipeline_parallel_size=stages, enable_chunked_prefill=True, max_num_batched_tokens=16
    )
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    with LLM(str(directory), **engine_args) as llm:
        check(llm.generate(PROMPTS, params, use_tqdm=False), expected)
        # Again: the prompts' blocks are in the prefix cache now, which these requests skip.
        check(llm.generate(PROMPTS, params, use_tqdm=False), expected)
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
        assert plain[0].num_cached_tokens > 0 and plain[0].prompt_logprobs is None
