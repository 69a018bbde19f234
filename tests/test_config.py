"""Bad settings fail up front with a message naming the setting, the value and the fix."""

import argparse
import dataclasses
import json
import shutil

import pytest

from pipellm import LLM, SamplingParams
from pipellm.config import ConfigError, EngineConfig
from pipellm.entrypoints.engine_args import add_engine_args
from pipellm.kernels import cpu_kernels
from pipellm.loader.source import ModelNotFoundError
from tests.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size=0"),
        (dict(pipeline_parallel_size=-2), "pipeline_parallel_size=-2"),
        (dict(pipeline_parallel_size=5), "only 4 layers"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
        (dict(max_model_len=100_000), "max_model_len=100000"),
        (dict(dtype="float8"), "dtype='float8'"),
        (dict(load_format="pt"), "load_format='pt'"),
        (dict(load_format="gguf"), "is a Hugging Face safetensors folder"),
        (dict(distributed_executor_backend="threads"), "distributed_executor_backend"),
        (dict(kv_cache_memory=1000), "kv_cache_memory"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "without chunked"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5"),
        (dict(pp_microbatch_tokens=0), "pp_microbatch_tokens=0"),
        (dict(pp_chunk_sizing="even"), "pp_chunk_sizing='even'"),
        (dict(pp_async_batch_depth=-1), "pp_async_batch_depth=-1"),
        (dict(pp_async_batch_depth=1), "need pipeline_parallel_size > 1"),
        (
            dict(pipeline_parallel_size=2, pp_async_batch_depth=1, pp_blocking_loop=True),
            "pp_blocking_loop keeps one micro-batch in flight",
        ),
        (dict(kv_cache_dtype="float8"), "kv_cache_dtype='float8'"),
        (dict(kv_cache_dtype="bfloat16"), "float32 or float16 (the CPU kernels' types)"),
        (dict(quantization="awq"), "quantization='awq'"),
        (dict(quantization="gguf"), "needs a .gguf model"),
        (dict(quantization="gguf_int8"), "needs a .gguf model"),
    ],
)
def test_bad_settings_are_named(tiny, settings, message):
    with pytest.raises(ConfigError, match="invalid setting") as error:
        EngineConfig(model=tiny, **settings)
    assert message in str(error.value)


def test_quantization_auto_keeps_gguf_weights_only_for_float32_gguf_models(tiny):
    assert EngineConfig(model=tiny).quantization == "none"
    assert EngineConfig().quantization == "gguf"  # the built-in GGUF model
    assert EngineConfig(dtype="bfloat16").quantization == "none"
    assert EngineConfig(quantization="none").quantization == "none"
    with pytest.raises(ConfigError, match="computes in float32"):
        EngineConfig(quantization="gguf", dtype="bfloat16")


def test_int8_activations_need_the_kernels(monkeypatch):
    """gguf_int8 runs on pipellm's kernels (any level): with them off, the setting fails
    before anything is built, naming why and the exact alternative."""
    monkeypatch.setenv("PIPELLM_CPU_KERNELS", "0")
    with pytest.raises(ConfigError, match="quantization='gguf_int8'.*turned off.*use gguf"):
        EngineConfig(quantization="gguf_int8")


@pytest.mark.skipif(
    "avx2" not in cpu_kernels.supported_levels() or cpu_kernels.why_unavailable() is not None,
    reason="needs pipellm's AVX2 kernels",
)
def test_int8_activations_run_on_the_avx2_level(monkeypatch):
    monkeypatch.setenv("PIPELLM_CPU_ISA", "avx2")
    assert EngineConfig(quantization="gguf_int8").quantization == "gguf_int8"


def test_unsupported_rope_scaling_fails_before_any_process_starts(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "m")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_scaling type 'dynamic' is not supported"):
        EngineConfig(model=str(directory), pipeline_parallel_size=2)


def test_unknown_engine_argument_is_rejected(tiny):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny, max_num_seq=4)


def test_missing_model_says_where_it_looked_and_never_downloads(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        EngineConfig(model=str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="preset"):
        EngineConfig(model="meta-llama/Llama-3-8B")


def test_dummy_weights_need_only_the_config(tiny, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", folder / name)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with (
        LLM(str(folder), load_format="dummy") as first,
        LLM(str(folder), load_format="dummy") as second,
    ):
        ids = [[5, 6, 7, 8]]
        assert (
            first.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
            == second.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
        ), "dummy weights are seeded"


def test_prompt_longer_than_max_model_len_is_rejected(tiny):
    with LLM(tiny, max_model_len=32) as llm:
        with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
            llm.generate([[5] * 8, [5] * 40], use_tqdm=False)
        # The engine is still usable afterwards.
        out = llm.generate([[5] * 8], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_cli_defaults_are_the_engine_config_defaults():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = vars(parser.parse_args([]))
    checked = 0
    for field in dataclasses.fields(EngineConfig):
        if field.init and field.name in args and field.default is not dataclasses.MISSING:
            assert args[field.name] == field.default, field.name
            checked += 1
    assert checked > 15


def test_a_visible_gpu_does_not_change_the_cpu_defaults(tiny, monkeypatch):
    # pipellm runs on the CPU only so far: a GPU in the machine must not make "auto" pick
    # bfloat16 for CPU tensors (the CPU kernels are float32) or nccl for CPU transfers.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig(model=str(tiny))
    assert config.torch_dtype == torch.float32


def test_gpu_only_settings_are_accepted_with_a_warning_and_change_nothing(tiny, caplog):
    """vLLM scripts pass gpu_memory_utilization; on CPU it must neither fail nor be silently
    taken as a cache size: kv_cache_memory alone sizes the KV cache."""
    plain = EngineConfig(model=tiny, load_format="dummy")
    with caplog.at_level("WARNING", logger="pipellm.config"):
        gpu = EngineConfig(model=tiny, load_format="dummy", gpu_memory_utilization=0.5)
    assert "gpu_memory_utilization has no effect on CPU" in caplog.text
    assert gpu.num_kv_blocks == plain.num_kv_blocks


def test_async_batch_depth_defaults_to_one_spare_micro_batch_on_ray_pipelines_only(tiny):
    def depth(**settings):
        config = EngineConfig(model=tiny, **settings)
        return config.pp_async_batch_depth, config.max_micro_batches_in_flight

    assert depth() == (0, 1)
    assert depth(pipeline_parallel_size=2) == (0, 2)  # mp
    assert depth(pipeline_parallel_size=2, distributed_executor_backend="ray") == (1, 3)
    assert depth(pipeline_parallel_size=2, distributed_executor_backend="sim") == (0, 2)
    assert depth(pipeline_parallel_size=2, pp_async_batch_depth=2) == (2, 4)
    explicit = dict(pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert depth(**explicit, pp_async_batch_depth=0) == (0, 2)
