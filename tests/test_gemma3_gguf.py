"""Gemma 3 270M (the PyPI Q4_K_M file) against llama.cpp: greedy tokens for 8 prompts x 32 new
tokens, two of them longer than the model's 512-token sliding window, at PP 1 (all 8) and at
PP 2, 3 and TP 2 (three of them, the longest included).

llama.cpp rounds activations to 8 bits before its quantized dot products and pipellm computes
in float32, so a sequence may part from llama.cpp's, but only at a near tie: where the token
pipellm chose is among llama.cpp's five most likely. The stored reference
(tests/data/gemma3_270m_q4_k_m_llama_cpp.json, from tests/llama_cpp_reference.py) always runs;
with llama-cpp-python importable, a second test computes it afresh.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipellm import LLM, SamplingParams
from pipellm.model.decode_fast_path import why_not_fused
from tests import llama_cpp_reference
from tests.gguf_models import require_gemma3_270m_gguf
from tests.test_decode_fast_path import BothPaths

REFERENCE = Path(__file__).parent / "data" / "gemma3_270m_q4_k_m_llama_cpp.json"
WINDOW = 512


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return require_gemma3_270m_gguf()


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(
        temperature=0, max_tokens=llama_cpp_reference.NUM_NEW_TOKENS, ignore_eos=True
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def generate(path: Path, prompts: list[list[int]], **engine_args) -> list[list[int]]:
    with LLM(str(path), max_model_len=1024, **engine_args) as llm:
        return greedy(llm, prompts)


def count_identical(tokens: list[list[int]], cases: list[dict]) -> int:
    """How many sequences equal llama.cpp's; fails if one parts from it other than at a near
    tie (pipellm's token outside llama.cpp's top 5 there)."""
    identical = 0
    for n, (mine, case) in enumerate(zip(tokens, cases, strict=True)):
        pairs = enumerate(zip(mine, case["tokens"], strict=True))
        parted = next((i for i, (a, b) in pairs if a != b), None)
        if parted is None:
            identical += 1
            continue
        top = dict(case["top_logprobs"][parted])
        assert mine[parted] in top, (
            f"prompt {n} ({len(case['prompt'])} tokens), new token {parted}: pipellm chose "
            f"{mine[parted]}, outside llama.cpp's top 5 {top}"
        )
        gap = top[case["tokens"][parted]] - top[mine[parted]]
        print(f"prompt {n}: parts from llama.cpp at new token {parted}, a near tie ({gap:.3f})")
    print(f"{identical} of {len(cases)} sequences identical to llama.cpp's")
    return identical


@pytest.fixture(scope="module")
def single_process(gemma_gguf) -> Iterator[LLM]:
    """One PP 1 engine for the module: its tokens are every other test's reference, and its
    stage is the one the fused-path test watches."""
    with LLM(str(gemma_gguf), max_model_len=1024) as llm:
        yield llm


@pytest.fixture(scope="module")
def single_process_tokens(single_process, reference) -> list[list[int]]:
    return greedy(single_process, [case["prompt"] for case in reference["cases"]])


def test_reference_covers_the_sliding_window(reference):
    lengths = [len(case["prompt"]) for case in reference["cases"]]
    assert len(lengths) == 8 and sum(n > WINDOW for n in lengths) >= 2


def test_greedy_tokens_match_llama_cpp(single_process_tokens, reference):
    assert count_identical(single_process_tokens, reference["cases"]) >= 1


@pytest.mark.parametrize(
    "engine_args",
    [dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=3), dict(tensor_parallel_size=2)],
    ids=["pp2", "pp3", "tp2"],
)
def test_parallel_layouts_give_the_same_tokens(
    gemma_gguf, reference, single_process_tokens, engine_args, reaped
):
    """A short, a middling and the longest prompt (kept to three for the suite's time)."""
    chosen = [0, 3, 7]
    cases = [reference["cases"][i] for i in chosen]
    tokens = generate(gemma_gguf, [case["prompt"] for case in cases], **engine_args)
    count_identical(tokens, cases)
    assert tokens == [single_process_tokens[i] for i in chosen]


def test_greedy_tokens_match_llama_cpp_computed_now(gemma_gguf, reference, single_process_tokens):
    reason = llama_cpp_reference.why_llama_cpp_unavailable()
    if reason is not None:
        pytest.skip(reason)
    prompts = [case["prompt"] for case in reference["cases"]]
    cases = llama_cpp_reference.greedy_with_top_logprobs(gemma_gguf, prompts)
    assert count_identical(single_process_tokens, cases) >= 1


def test_decode_steps_take_the_fused_path(single_process, reference):
    """The longest prompt (past the 512-token window): each decode step on the fused path
    (model/decode_fast_path.py) gives the Python path's hidden states, bit for bit."""
    longest = max(reference["cases"], key=lambda case: len(case["prompt"]))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    stage = single_process.engine.executor.worker.model
    assert stage.decode_fast_path is not None, why_not_fused(stage)
    both = BothPaths(stage)
    try:
        single_process.generate([longest["prompt"]], params, use_tqdm=False)
    finally:
        stage.decode_fast_path = both.fused
        del stage.forward  # BothPaths wrapped the bound method on the instance
    assert both.steps == params.max_tokens - 1
