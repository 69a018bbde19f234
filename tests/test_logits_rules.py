"""Penalties, logit_bias, bad words and min_tokens against a plain reference of vLLM's rules."""

import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.model.logits_rules import OutputTokenCounts, RowRules, TokenCounts, apply_logits_rules
from pipellm.protocol import ScheduledRequest, SchedulerOutput
from tests.checkpoints import make_tiny_checkpoint

VOCAB = 12
PROMPT = [3, 3, 5, 7]
OUTPUT = [5, 9, 9, 9, 1]


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams):
    """vLLM's formulas written out per token, one row at a time (no tensors)."""
    out = list(logits)
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            out[word[-1]] = float("-inf")
    if len(output) < p.min_tokens:
        for t in p.all_stop_token_ids:
            out[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        if t in prompt or t in output:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= p.frequency_penalty * output.count(t)
        out[t] -= p.presence_penalty * (t in output)
    return out


def resolved(**kwargs) -> SamplingParams:
    words = {"ab": [4, 6], "c": [8]}  # a toy tokenizer: each bad word's ids
    return SamplingParams(**kwargs).resolve((2,), lambda text: words[text.strip()], VOCAB)


CASES = [
    dict(presence_penalty=1.5),
    dict(presence_penalty=-0.7),
    dict(frequency_penalty=0.6),
    dict(frequency_penalty=-1.1),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.8),
    dict(logit_bias={0: 5.0, 9: -100.0, 11: 2.5}),
    dict(
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={5: 1.0, 7: -3.0},
    ),
    dict(min_tokens=10, stop_token_ids=[10]),
    dict(bad_words=["c"]),
]


@pytest.mark.parametrize("kwargs", CASES)
def test_rules_match_the_reference(kwargs):
    params = resolved(**kwargs)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    tokens = PROMPT + OUTPUT
    counts = TokenCounts.of(tokens, len(OUTPUT), VOCAB) if params.has_penalties else None
    rows = [None, RowRules(params, len(OUTPUT), tokens, counts), None]
    got = apply_logits_rules(logits, rows)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    expected = reference(logits[1].tolist(), PROMPT, OUTPUT, params)
    assert got[1].tolist() == pytest.approx(expected, abs=1e-5)
    assert got[1].tolist() != pytest.approx(logits[1].tolist(), abs=1e-5), "the rule did act"


def test_bad_word_of_two_tokens_bans_its_last_token_after_its_first():
    params = resolved(bad_words=["ab"])
    logits = torch.zeros(2, VOCAB)
    after_4 = RowRules(params, 2, PROMPT + [1, 4])
    after_1 = RowRules(params, 2, PROMPT + [4, 1])
    got = apply_logits_rules(logits, [after_4, after_1])
    assert got[0, 6] == float("-inf") and torch.isfinite(got[1]).all()


def test_counts_follow_the_scheduler_outputs():
    """New requests (also resumed after preemption) count their outputs; later steps add."""
    counts = OutputTokenCounts(VOCAB)
    params = SamplingParams(frequency_penalty=1.0)
    new = ScheduledRequest("r", 0, 6, PROMPT + [5, 9], [0], params, num_output_tokens=2)
    counts.update(SchedulerOutput(0, [new]))
    counts.update(SchedulerOutput(1, [ScheduledRequest("r", 6, 1, [9], [])]))
    expected = TokenCounts.of(PROMPT + [5, 9, 9], 3, VOCAB)
    assert torch.equal(counts.requests["r"].output_counts, expected.output_counts)
    assert torch.equal(counts.requests["r"].seen, expected.seen)
    counts.update(SchedulerOutput(2, [], freed_request_ids=["r"]))
    assert counts.requests == {}


def test_plain_rows_are_not_copied():
    logits = torch.randn(2, VOCAB)
    plain = RowRules(SamplingParams(temperature=0), 0, PROMPT)
    assert apply_logits_rules(logits, [plain, None]) is logits


def test_sampling_params_reject_bad_penalties_and_ids():
    for bad in (
        dict(presence_penalty=3),
        dict(frequency_penalty=-2.5),
        dict(repetition_penalty=0),
    ):
        with pytest.raises(ValueError, match="invalid sampling parameter"):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="token id 99"):
        resolved(logit_bias={99: 1.0})


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(str(make_tiny_checkpoint(tmp_path_factory.mktemp("m")))) as engine:
        yield engine


def test_engine_applies_the_rules(llm):
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [[5, 6, 7]]
    plain = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert len(set(plain.token_ids)) < len(plain.token_ids), "greedy repeats on this model"
    fresh = SamplingParams(**greedy, presence_penalty=2.0, repetition_penalty=2.0)
    out = llm.generate(prompt, fresh, use_tqdm=False)[0].outputs[0]
    assert len(set(out.token_ids)) == len(out.token_ids)
    forced = SamplingParams(**greedy, logit_bias={42: 100.0})
    assert llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 12
    # min_tokens holds EOS back: with EOS favoured it comes only at the 5th token.
    eos = llm.engine.eos_token_ids[0]
    eager = dict(temperature=0, max_tokens=12, logit_bias={eos: 100.0})
    out = llm.generate(prompt, SamplingParams(**eager, min_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids[-1] == eos and len(out[0].outputs[0].token_ids) == 5
