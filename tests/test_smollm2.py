"""The built-in model: a real answer, and the same tokens split over two pipeline stages or
two tensor-parallel ranks."""

import pytest

from pipellm import LLM, SamplingParams
from pipellm.kernels.cpu_kernels import cpu_kernels_available, int8_activations_unavailable
from pipellm.loader import weights
from pipellm.model.gguf_linear import QuantizedLinear
from pipellm.model.linear import PackedLinear

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dequantized_at_load() -> list[str]:
    """The weights single_stage's load dequantized, by name."""
    return []


@pytest.fixture(scope="module")
def single_stage(dequantized_at_load):
    """One process with the built-in model for every test here (its load is watched)."""
    real = weights._dequantize
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            weights,
            "_dequantize",
            lambda t, *rest: dequantized_at_load.append(t.name) or real(t, *rest),
        )
        llm = LLM()
    with llm:
        yield llm


def test_answers_the_capital_of_france(single_stage):
    answer = single_stage.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in answer[0].outputs[0].text
    assert answer[0].outputs[0].finish_reason == "stop", "the model ends its turn"


def test_weights_taken_quantized_are_never_dequantized(single_stage, dequantized_at_load):
    """The load's peak memory is the quantized model: only the norms are dequantized (the
    embedding's lookup dequantizes the rows it looks up, model/quantized_embedding.py). The
    module's engine is the one watched; the test above shows it answers."""
    if not cpu_kernels_available():
        pytest.skip("CPU kernels unavailable: the float32 path runs")
    dequantized = dequantized_at_load
    assert dequantized and all("norm" in name for name in dequantized), dequantized


@pytest.fixture(scope="module")
def long_prompts_tokens(single_stage) -> tuple[list[str], list[list[int]]]:
    """PROMPTS and a 150-odd-token prompt, and one process's greedy tokens for them."""
    prompts = PROMPTS + [" ".join(f"item {i} of the list;" for i in range(30))]
    return prompts, [o.outputs[0].token_ids for o in single_stage.generate(prompts, GREEDY)]


def same_tokens_and_an_answer(expected: tuple[list[str], list[list[int]]], **layout) -> None:
    """The layout's greedy tokens are one process's, and it answers the question."""
    prompts, tokens = expected
    with LLM(**layout) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        answer = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))
    assert got == tokens, layout
    assert "Paris" in answer[0].outputs[0].text, layout


def test_three_stages_give_the_same_tokens(long_prompts_tokens, reaped):
    """Three stages balanced with the chunked pipeline (the 150-odd-token prompt cut into
    chunks of 37, none a multiple of the 16-token block, several in flight at once). Two
    stages, unbalanced, run in the tensor-parallel test below; two balanced stages would add
    no stage role three lack (first, last), so they are not run again (test_chunked_pipeline
    covers both sizes on a tiny model)."""
    same_tokens_and_an_answer(
        long_prompts_tokens,
        pipeline_parallel_size=3,
        pp_balance=True,
        enable_chunked_pipeline=True,
        pp_microbatch_tokens=37,
    )


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "tp2-pp2-unbalanced"])
def test_tensor_parallel_gives_the_same_tokens(long_prompts_tokens, reaped, pp):
    """T = 2 splits each of SmolLM2's projections in half: q/k/v rows cutting query head 4 and
    KV head 1 (all-gathered; heads 0-4 on KV heads 0-1 and 4-8 on 1-2: uneven query runs
    per KV head in the attention kernels), o_proj's and down_proj's Q4_1 columns on their
    32-value blocks; alone, and with two pipeline stages (4 ranks, 1 thread each) left
    unbalanced without the chunked pipeline (--no-pp-balance: the whole batch in one
    micro-batch, vLLM issue #27462), the greedy tokens are one process's."""
    layout = dict(tensor_parallel_size=2, pipeline_parallel_size=pp, num_threads=1)
    if pp == 2:
        layout.update(pp_balance=False, enable_chunked_pipeline=False, pp_microbatch_tokens=37)
    same_tokens_and_an_answer(long_prompts_tokens, **layout)


def test_gguf_weights_computed_as_stored_give_the_same_numbers(single_stage):
    """By default the Q4_1/Q8_0 weights stay quantized (model/gguf_linear.py); the results are
    those of the float32 weights, to the last bit of every logprob."""
    model = single_stage.engine.executor.worker.model
    if not cpu_kernels_available():
        pytest.skip("CPU kernels unavailable: the float32 path runs")
    assert single_stage.config.quantization == "gguf"
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(model.lm_head, QuantizedLinear)  # the tied Q8_0 embedding
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    quantized = single_stage.generate(PROMPTS, params)
    with LLM(quantization="none") as llm:
        assert isinstance(llm.engine.executor.worker.model.lm_head, PackedLinear)
        dequantized = llm.generate(PROMPTS, params)
    for a, b in zip(quantized, dequantized, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_int8_activations_keep_nearly_every_greedy_token(single_stage):
    """quantization="gguf_int8" (opt-in) rounds activations to int8: not the same bits, but
    read with the exact path's own continuations as context (teacher-forced), its top-1 token
    is the exact one nearly everywhere (benchmarks/int8_agreement.py measures it at scale).
    Its free-running chat answer is not checked: rounded as llama.cpp rounds activations, this
    file answers the capital question as llama.cpp does on it (greedy, "L'Étoile, la ..."),
    not "Paris" as the exact path does."""
    if int8_activations_unavailable() is not None:
        pytest.skip(f"int8 activations unavailable: {int8_activations_unavailable()}")
    runs = single_stage.generate(PROMPTS, GREEDY)
    texts = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in runs]
    read = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def top1(llm):
        outputs = llm.generate(texts, read)
        entries = [entry for o in outputs for entry in o.prompt_logprobs[1:]]
        return [top[0][0] for _, top in entries], [logprob for logprob, _ in entries]

    exact, exact_logprobs = top1(single_stage)
    with LLM(quantization="gguf_int8") as llm:
        model = llm.engine.executor.worker.model
        assert model.layers[0].mlp.down_proj.int8_activations
        assert model.lm_head.int8_activations
        int8, int8_logprobs = top1(llm)
    agree = sum(a == b for a, b in zip(exact, int8, strict=True)) / len(exact)
    assert agree >= 0.9
    assert int8_logprobs != exact_logprobs  # really the other arithmetic
