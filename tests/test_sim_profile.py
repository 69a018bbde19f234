"""Sim profiles: shapes from Hugging Face configs (dense, MLA, mixture of experts), the roofline
and linear cost models, and clear errors for malformed files."""

import json
from pathlib import Path

import pytest

from pipellm.config import ConfigError, EngineConfig
from pipellm.protocol import ScheduledRequest, SchedulerOutput
from pipellm.sim.profile import ProfileError, load_profile
from pipellm.sim.shapes import BatchShape, model_shape
from tests.sim_models import make_word_model, write_profile

PROFILES = Path(__file__).parent.parent / "pipellm" / "sim" / "profiles"
DEEPSEEK = json.loads((PROFILES / "deepseek_r1_0528_config.json").read_text())


def batch(*chunks: tuple[int, int]) -> BatchShape:
    """Requests given as (cached tokens, scheduled tokens), each sampling."""
    requests = [
        ScheduledRequest(str(i), cached, n, [], [], sample=True)
        for i, (cached, n) in enumerate(chunks)
    ]
    return BatchShape.of(SchedulerOutput(0, requests))


def test_deepseek_r1_has_its_published_size():
    """671B parameters, 37B active per token (DeepSeek-V3 technical report), from config.json."""
    shape = model_shape(DEEPSEEK)
    dense, moe = shape.layers[0], shape.layers[3]
    assert (dense.num_experts, moe.num_experts, moe.experts_per_token) == (0, 256, 8)
    assert sum(layer.num_experts == 0 for layer in shape.layers) == 3  # first_k_dense_replace
    assert moe.kv_elements_per_token == 512 + 64  # MLA caches the latent and the rotary key
    total = sum(x.dense_params + x.num_experts * x.expert_params for x in shape.layers)
    active = sum(x.dense_params + x.experts_per_token * x.expert_params for x in shape.layers)
    embeddings = 2 * shape.head_params
    assert (total + embeddings) / 1e9 == pytest.approx(671, abs=1)
    assert (active + embeddings) / 1e9 == pytest.approx(37.5, abs=0.5)


def test_routed_experts_touched_grow_with_the_batch():
    moe = model_shape(DEEPSEEK).layers[3]
    assert moe.expected_experts_touched(1) == pytest.approx(8)
    assert 50 < moe.expected_experts_touched(8) < 64  # some tokens share experts
    assert moe.expected_experts_touched(4000) == pytest.approx(256)


def test_grouped_query_attention_and_mixtral_style_experts():
    cfg = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "vocab_size": 100,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    layer = model_shape(cfg).layers[0]
    assert layer.kv_elements_per_token == 2 * 2 * 16
    assert layer.expert_params == 3 * 64 * 32 and layer.num_experts == 4
    assert layer.dense_params == 64 * (64 + 2 * 32) + 64 * 64 + 64 * 4  # attention + router


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    profile = load_profile(PROFILES / "deepseek_r1_fp4_pp8_rtx_pro_6000.json")
    first = profile.stage_costs({}, 8)[1]
    hw = profile.hardware
    decode_1, decode_8 = first.seconds(batch((4000, 1))), first.seconds(batch(*[(4000, 1)] * 8))
    # Eight rows read ~7x the experts of one: the routed experts dominate a decode step.
    assert 2 < (decode_8 - hw.step_overhead_s) / (decode_1 - hw.step_overhead_s) < 8
    prefill = first.seconds(batch((0, 4000))) - hw.step_overhead_s
    flops = 2 * 4000 * sum(x.dense_params + 8 * x.expert_params for x in first.layers)
    assert prefill > flops / hw.flops_per_s  # at least the GEMMs at peak, plus attention


def test_linear_profile_and_its_kv_capacity(tmp_path):
    model = make_word_model(tmp_path / "m", num_layers=4)
    coefficients = {"step_s": 0.01, "layer_token_s": 0.001, "head_sampled_s": 0.1}
    path = write_profile(
        tmp_path / "p.json",
        {"cost_model": "linear", "linear": coefficients, "kv_capacity_tokens": 2000},
    )
    profile = load_profile(path)
    first, last = profile.stage_costs(model_shape_of(model), 2)
    assert first.seconds(batch((0, 10))) == pytest.approx(0.01 + 2 * 0.001 * 10)
    assert last.seconds(batch((0, 10))) == pytest.approx(0.01 + 2 * 0.001 * 10 + 0.1)
    config = EngineConfig(
        model=str(model), distributed_executor_backend="sim", sim_profile=path, block_size=16
    )
    assert config.num_kv_blocks == 125  # 2000 tokens in blocks of 16


def test_a_fit_per_pipeline_size_and_the_concurrent_slowdown(tmp_path):
    """linear_by_stages[P] replaces `linear` for a pipeline of P stages; concurrent_slowdown
    gives the factor per number of stages computing at once, its last value beyond."""
    model = make_word_model(tmp_path / "m", num_layers=4)
    data = {
        "cost_model": "linear",
        "linear": {"step_s": 0.01},
        "linear_by_stages": {"2": {"step_s": 0.02}},
        "concurrent_slowdown": [1.0, 1.5, 2.5],
    }
    profile = load_profile(write_profile(tmp_path / "p.json", data))
    assert [c.seconds(batch((0, 1))) for c in profile.stage_costs(model_shape_of(model), 2)] == [
        0.02,
        0.02,
    ]
    assert profile.stage_costs(model_shape_of(model), 4)[0].seconds(batch((0, 1))) == 0.01
    assert [profile.slowdown(k) for k in (1, 2, 3, 4)] == [1.0, 1.5, 2.5, 2.5]
    assert profile.stages_interfere


def test_measured_steps_pull_the_line_toward_them(tmp_path):
    """At a measured shape the cost is near its measurement (the line's weight 0.05 against
    the shape's 1: exp(ln 2 / 1.05) = 1.935x the line where the measurement is 2x); far from
    every measured shape it is the line; only stages of the measured kind are pulled."""
    model = make_word_model(tmp_path / "m", num_layers=4)
    measured = {"num_tokens": 4, "num_requests": 4, "num_sampled": 4, "attention_pairs": 516}
    measured |= {"context_tokens": 516}
    line = 0.01 + 2 * 0.001 * 4  # step_s + 2 layers x layer_token_s x 4 tokens
    step = {"pipeline_parallel_size": 2, "layers": 2, "last_stage": False, **measured}
    data = {
        "cost_model": "linear",
        "linear": {"step_s": 0.01, "layer_token_s": 0.001},
        "measured_steps": [{**step, "measured_s": 2 * line, "fitted_s": line}],
    }
    profile = load_profile(write_profile(tmp_path / "p.json", data))
    first, last = profile.stage_costs(model_shape_of(model), 2)
    at_the_point = BatchShape(**measured)
    assert first.seconds(at_the_point) == pytest.approx(line * 2 ** (1 / 1.05))
    assert last.seconds(at_the_point) == pytest.approx(line)  # a last stage was not measured
    far = BatchShape(num_tokens=400, num_requests=1, num_sampled=1, attention_pairs=80200,
                     context_tokens=400)  # fmt: skip
    assert first.seconds(far) == pytest.approx(0.01 + 2 * 0.001 * 400)
    # Nearer than the next grid point (4 rows at 616 context, ~0.6 SCALE in two features):
    # most of the way, less than at the point itself.
    near = BatchShape(num_tokens=4, num_requests=4, num_sampled=4, attention_pairs=616,
                      context_tokens=616)  # fmt: skip
    assert line * 1.6 < first.seconds(near) < line * 2 ** (1 / 1.05)
    assert profile.stage_costs(model_shape_of(model), 4)[0].seconds(at_the_point) == (
        pytest.approx(0.01 + 1 * 0.001 * 4)
    )


def model_shape_of(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


@pytest.mark.parametrize(
    "profile, message",
    [
        ({"cost_model": "magic"}, "cost_model must be one of"),
        ({"cost_model": "linear"}, "'linear' section is missing"),
        ({"cost_model": "linear", "linear": {"stepp_s": 1}}, "unknown field(s) ['stepp_s']"),
        ({"cost_model": "linear", "linear": {"step_s": -1}}, "linear.step_s must be a number"),
        ({"cost_model": "roofline", "hardware": {"flops_per_s": 1}}, "bytes_per_s"),
        ({"cost_model": "linear", "linear": {}, "hardware": {}}, "unknown field(s) ['hardware']"),
        (
            {"cost_model": "linear", "linear": {}, "linear_by_stages": {"two": {}}},
            "linear_by_stages must be an object keyed by pipeline size",
        ),
        (
            {"cost_model": "linear", "linear": {}, "linear_by_stages": {"2": {"step": 1}}},
            "linear_by_stages.2: unknown field(s) ['step']",
        ),
        (
            {"cost_model": "linear", "linear": {}, "concurrent_slowdown": [1, 0]},
            "concurrent_slowdown must be a list of numbers > 0",
        ),
        (
            {"cost_model": "linear", "linear": {}, "measured_steps": [{"layers": 2}]},
            "measured_steps[0]: missing pipeline_parallel_size",
        ),
        (
            {"cost_model": "roofline", "hardware": {}, "measured_steps": []},
            "unknown field(s) ['measured_steps']",
        ),
    ],
)
def test_malformed_profiles_name_the_field(tmp_path, profile, message):
    path = write_profile(tmp_path / "bad.json", profile)
    with pytest.raises(ProfileError, match="sim profile .*bad.json") as error:
        load_profile(path)
    assert message in str(error.value)


def test_a_profile_needs_the_sim_backend(tmp_path):
    model = make_word_model(tmp_path / "m")
    path = write_profile(tmp_path / "p.json", {"cost_model": "linear", "linear": {}})
    with pytest.raises(ConfigError, match="sim_profile.*distributed_executor_backend=sim"):
        EngineConfig(model=str(model), pipeline_parallel_size=2, sim_profile=path)
    with pytest.raises(ConfigError, match="cannot read it"):
        EngineConfig(
            model=str(model),
            distributed_executor_backend="sim",
            sim_profile=str(tmp_path / "missing.json"),
        )
