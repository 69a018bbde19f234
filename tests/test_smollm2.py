"""The built-in model: a real answer, and the same tokens split over two pipeline stages."""

import pytest

from pipellm import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def single_stage():
    with LLM() as llm:
        yield llm


def test_answers_the_capital_of_france(single_stage):
    answer = single_stage.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in answer[0].outputs[0].text
    assert answer[0].outputs[0].finish_reason == "stop", "the model ends its turn"


def test_two_stages_give_the_same_tokens(single_stage, reaped):
    expected = [o.outputs[0].token_ids for o in single_stage.generate(PROMPTS, GREEDY)]
    for balance in (True, False):
        with LLM(pipeline_parallel_size=2, pp_balance=balance) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
            answer = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))
        assert got == expected
        assert "Paris" in answer[0].outputs[0].text
