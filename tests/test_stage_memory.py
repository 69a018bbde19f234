"""A stage holds its weights, its KV cache and a fixed runtime, and little else; its host's
limit is checked before anything loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipellm import LLM, SamplingParams
from pipellm.config import EngineConfig
from pipellm.kernels.cpu_kernels import cpu_kernels_available
from pipellm.loader.gguf_tensors import map_tensors, read_tensor_index
from pipellm.loader.weights import gguf_tensor_bytes
from pipellm.worker.stage_memory import (
    HostLimit,
    HostMemoryError,
    StageMemory,
    check_host_fits,
    host_limit,
    resident_bytes,
    stage_weight_bytes,
)

MIB = 1 << 20
# What every stage process runs before it loads a model: the interpreter, torch, pipellm's
# stage modules and its CPU kernels.
RUNTIME_PROBE = """
from pipellm.worker.pipeline_stage import PipelineStage
from pipellm.kernels.cpu_kernels import cpu_kernels_available
from pipellm.worker.stage_memory import resident_bytes
cpu_kernels_available()
print(resident_bytes())
"""


def fixed_runtime() -> int:
    done = subprocess.run(
        [sys.executable, "-c", RUNTIME_PROBE], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(
    not cpu_kernels_available(),
    reason="the GGUF weights stay quantized only with pipellm's CPU kernels",
)
def test_a_stage_holds_its_weights_its_kv_cache_and_a_fixed_runtime(reaped):
    runtime = fixed_runtime()
    with LLM(pipeline_parallel_size=2, max_model_len=1024, kv_cache_memory=64 * MIB) as llm:
        prompts = ["The history of the printing press " * 20, "def fibonacci(n):"]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        executor = llm.engine.executor
        loaded = executor.stage_memory
        resident = [resident_bytes(process.pid) for process in executor.processes]
        config = llm.config
    file_bytes = gguf_tensor_bytes(config.source.path)
    embedding = next(
        e for e in read_tensor_index(config.source.path) if e.name == "token_embd.weight"
    )
    report = [
        f"{stage.name}: resident {r / MIB:.0f} MiB, runtime {runtime / MIB:.0f}, weights "
        f"{stage.weights / MIB:.1f}, KV {stage.planned.kv_cache / MIB:.1f}"
        for stage, r in zip(loaded, resident, strict=True)
    ]
    print("\n".join(report))
    for stage, r in zip(loaded, resident, strict=True):
        # Its layers' half of the pipeline's 64 MiB (whole blocks).
        assert stage.planned.kv_cache == pytest.approx(32 * MIB, rel=0.01)
        assert r <= 1.3 * (runtime + stage.weights + stage.planned.kv_cache), report
        # The plan, made before loading, is what the stage then holds.
        assert stage.planned.weights == pytest.approx(stage.weights, rel=0.05)
    # Every tensor of the file is held once, and the tied embedding twice: the first stage
    # looks tokens up in it, the last stage's lm_head multiplies by it.
    held = sum(stage.weights for stage in loaded)
    assert held == pytest.approx(file_bytes + embedding.n_bytes, rel=0.05), report


def test_planned_weights_add_up_to_the_file():
    config = EngineConfig(pipeline_parallel_size=3)
    planned = [stage_weight_bytes(config, s) for s in range(3)]
    embedding = next(
        e for e in read_tensor_index(config.source.path) if e.name == "token_embd.weight"
    )
    assert sum(planned) == pytest.approx(
        gguf_tensor_bytes(config.source.path) + embedding.n_bytes, rel=0.02
    )
    # The middle stage holds layers only: no embedding, no lm_head.
    assert planned[1] < planned[0] and planned[1] < planned[2]


def test_the_tensor_index_is_the_readers():
    import gguf

    config = EngineConfig()
    ours = map_tensors(config.source.path)
    theirs = gguf.GGUFReader(config.source.path).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert (a.tensor_type, a.n_bytes, a.data_offset) == (
            b.tensor_type,
            b.n_bytes,
            b.data_offset,
        )
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert (a.data[:2] == b.data[:2]).all()


def test_a_host_too_small_fails_before_loading_naming_the_host_the_need_and_the_limit():
    stage = StageMemory(weights=300 * MIB, kv_cache=64 * MIB, workspace=20 * MIB, runtime=0)
    small = HostLimit(limit=512 * MIB, in_use=300 * MIB, source="cgroup memory.limit_in_bytes")
    with pytest.raises(HostMemoryError) as error:
        check_host_fits("10.0.0.12 (node-b)", {"pipeline stage 0": stage}, small)
    message = str(error.value)
    assert "host 10.0.0.12 (node-b)" in message and "pipeline stage 0" in message
    assert "needs 384.0 MiB" in message and "memory limit is 512.0 MiB" in message
    assert "leaves 212.0 MiB" in message
    check_host_fits("big", {"s": stage}, HostLimit(1 << 40, 300 * MIB, "physical memory"))


def test_this_host_has_a_limit_and_uses_part_of_it():
    limit = host_limit()
    assert 0 < limit.in_use < limit.limit
