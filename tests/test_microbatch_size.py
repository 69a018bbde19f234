"""`--pp-microbatch-tokens` auto: 128 on real stages; on modelled ones, from the stage cost."""

from pathlib import Path

from pipellm.config import EngineConfig
from pipellm.engine.microbatch_size import DEFAULT_MICROBATCH_TOKENS, microbatch_tokens
from pipellm.executor.sim import profile_for
from pipellm.sim.shapes import BatchShape
from tests.sim_models import make_word_model, write_profile

GPU_PROFILE = (
    Path(__file__).parents[1] / "pipellm/sim/profiles/deepseek_r1_fp4_pp8_rtx_pro_6000.json"
)


def test_cpu_stages_keep_128_and_a_setting_wins(tmp_path):
    assert microbatch_tokens(EngineConfig(pipeline_parallel_size=2)) == 128  # built-in model
    assert microbatch_tokens(EngineConfig(pp_microbatch_tokens=300)) == 300
    model = str(make_word_model(tmp_path / "m"))
    # Modelled stages whose step costs the same at every size: no size amortizes better.
    flat = write_profile(tmp_path / "p.json", {"cost_model": "linear", "linear": {"step_s": 0.1}})
    config = EngineConfig(model=model, distributed_executor_backend="sim", sim_profile=flat)
    assert microbatch_tokens(config) == DEFAULT_MICROBATCH_TOKENS


def test_a_moe_gpu_stage_gets_micro_batches_its_weight_reads_do_not_dominate():
    """DeepSeek-R1 on 8 GPUs: 128 tokens touch nearly every expert, so a 128-token step is
    mostly reading weights; the auto size is the first doubling of 128 whose step is at
    most a fifth fixed cost, and the one before it is not."""
    config = EngineConfig(
        distributed_executor_backend="sim",
        sim_profile=str(GPU_PROFILE),
        pipeline_parallel_size=8,
        max_num_batched_tokens=32000,
        max_model_len=4042,
    )
    tokens = microbatch_tokens(config)
    assert 128 < tokens < 32000
    served = config.model_config.hf_config_kwargs()
    cost = profile_for(config).stage_costs(served, 8)[0]

    def per_token(n: int) -> float:
        return cost.seconds(BatchShape(n, 1, 0, float(n), n)) / n

    marginal = (
        cost.seconds(BatchShape(32000, 1, 0, 32000.0, 32000))
        - cost.seconds(BatchShape(16000, 1, 0, 16000.0, 16000))
    ) / 16000
    assert per_token(tokens) * 0.8 <= marginal * 1.0001
    assert per_token(tokens // 2) * 0.8 > marginal
    assert per_token(128) > 3 * marginal
