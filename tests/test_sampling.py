"""Sampling rules, seeds, logprobs and stop conditions."""

import math

import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.engine.output_processor import TextState
from pipellm.engine.request import Request
from pipellm.model import sampler
from pipellm.model.sampler import sample
from tests.checkpoints import make_tiny_checkpoint

GENERATOR = torch.Generator().manual_seed(0)


def draw(logits: list[float], params: SamplingParams, n: int = 1) -> list[int]:
    row = torch.tensor([logits])
    return [sample(row, [params], [i], GENERATOR)[0][0] for i in range(n)]


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = [0.1, 2.0, 1.9, -1.0]
    assert draw(logits, SamplingParams(temperature=0)) == [1]
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=1), 50)) == {1}
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.01), 50)) == {1}
    assert set(draw(logits, SamplingParams(temperature=1.0, min_p=1.0), 50)) == {1}


def test_filters_keep_only_allowed_tokens():
    logits = [3.0, 2.9, 2.8, -5.0, -5.0]
    assert set(draw(logits, SamplingParams(temperature=1.0, top_k=2), 200)) == {0, 1}
    # min_p 0.5: token 2 has exp(-0.2) = 0.82 of the top probability and stays; 3 and 4 go.
    assert set(draw(logits, SamplingParams(temperature=1.0, min_p=0.5), 300)) == {0, 1, 2}


def test_temperature_sampling_follows_the_distribution():
    logits = [math.log(0.7), math.log(0.3)]
    draws = draw(logits, SamplingParams(temperature=1.0), 4000)
    assert abs(draws.count(0) / len(draws) - 0.7) < 0.04


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(1000).tolist()
    a = draw(logits, SamplingParams(temperature=1.0, seed=7), 20)
    b = draw(logits, SamplingParams(temperature=1.0, seed=7), 20)
    c = draw(logits, SamplingParams(temperature=1.0, seed=8), 20)
    assert a == b and a != c


@pytest.mark.parametrize("seed", [2**63 - 1, 2**64, 2**70, -1, -(2**80), 10**100])
def test_any_integer_seed_samples_reproducibly(seed):
    # seed * 1_000_003 + position overflowed torch's 64-bit seed and killed the stage.
    logits = torch.randn(1000).tolist()
    a = draw(logits, SamplingParams(temperature=1.0, seed=seed), 20)
    assert a == draw(logits, SamplingParams(temperature=1.0, seed=seed), 20)
    assert a != draw(logits, SamplingParams(temperature=1.0, seed=seed + 1), 20)


def test_a_row_whose_sampling_fails_fails_alone():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    # More top logprobs than the vocabulary has: topk raises, for row 1 only.
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=9)] * 2
    tokens, logprobs, failed = sample(logits, params[:3], [0, 0, 0], GENERATOR)
    assert list(failed) == [1] and "RuntimeError" in failed[1]
    assert tokens[0] == tokens[2] == 1 and logprobs[0] is None


def test_logprobs_are_log_softmax_of_the_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, logprobs, failed = sample(
        logits, [SamplingParams(temperature=0, logprobs=2)], [0], GENERATOR
    )
    assert failed == {}
    expected = logits.log_softmax(-1)[0]
    sampled_logprob, top = logprobs[0]
    assert tokens == [1]
    assert sampled_logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in top] == [1, 2]
    assert [lp for _, lp in top] == pytest.approx([float(expected[1]), float(expected[2])])


def test_sampling_params_reject_bad_values():
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-3),
        dict(max_tokens=0),
        dict(n=0),
        dict(min_p=2),
        dict(logprobs=50),
    ):
        with pytest.raises(ValueError, match="invalid sampling parameter"):
            SamplingParams(**bad)


def test_eos_stops_unless_ignored():
    def run(params: SamplingParams) -> str | None:
        request = Request("r", [1, 2, 3], params, eos_token_ids=(9,))
        request.append_output_token(9)
        stop = request.token_stop(max_model_len=100)
        return stop[0] if stop else None

    assert run(SamplingParams()) == "stop"
    assert run(SamplingParams(ignore_eos=True)) is None
    assert run(SamplingParams(min_tokens=2)) is None


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(str(make_tiny_checkpoint(tmp_path_factory.mktemp("m")))) as engine:
        yield engine


def test_seed_gives_the_same_sample_alone_or_in_a_batch(llm):
    prompt = [[5, 6, 7, 8, 9]]
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [[11, 12, 13]] * 5
    batch = llm.generate(
        prompt + others,
        [seeded] + [SamplingParams(temperature=1.0, max_tokens=16)] * 5,
        use_tqdm=False,
    )
    assert batch[0].outputs[0].token_ids == alone


def test_stop_string_truncates_text_and_reports_it(llm):
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    full = llm.generate([[5, 6, 7, 8, 9]], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[10:13]
    assert len(stop) == 3
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
    out = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_id_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_token = full.token_ids[6]
    first = full.token_ids.index(stop_token)
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token]
    )
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token


def test_logprobs_flow_through_the_engine(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, (logprob, top) in zip(out.token_ids, out.logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob)
        assert len(top) == 3


def test_a_request_failing_in_sampling_or_detokenizing_fails_alone(llm, monkeypatch):
    """Each failure ends its own request with finish_reason "error"; the others finish and
    the engine serves the next call."""
    real_random_token, real_push = sampler._random_token, TextState.push

    def random_token(logits, params, position, generator):
        if params.seed == 666:
            raise RuntimeError("injected sampling failure")
        return real_random_token(logits, params, position, generator)

    def push(self, token_id, finished):
        if "injected" in self.params.stop:
            raise RuntimeError("injected detokenizing failure")
        return real_push(self, token_id, finished)

    monkeypatch.setattr(sampler, "_random_token", random_token)
    monkeypatch.setattr(TextState, "push", push)
    ok = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    bad_sample = SamplingParams(temperature=1.0, seed=666, max_tokens=6, ignore_eos=True)
    bad_text = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["injected"])
    outs = llm.generate([[5, 6, 7]] * 4, [ok, bad_sample, bad_text, ok], use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "error", "error", "length"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 0, 0, 6]
    again = llm.generate([[5, 6, 7]], ok, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == outs[0].outputs[0].token_ids
