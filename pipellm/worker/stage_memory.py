"""What a pipeline stage holds in memory, and whether its host has room for it, before loading.

A stage's resident memory is its weights, its layers' share of the KV cache, the activations
of its largest micro-batch (workspace) and a fixed runtime (the interpreter, torch, pipellm's
kernels), which the stage measures in itself before it loads anything. A host's limit is the
smallest of its physical memory and the memory cgroup its processes run in (cgroup v1
`memory.limit_in_bytes` or v2 `memory.max`, as container runtimes and systemd set them); what
its processes already hold counts against it (the cgroup's usage less its inactive file cache,
the working set as Kubernetes counts it, or MemTotal - MemAvailable without a cgroup).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipellm.config import EngineConfig
from pipellm.loader.weights import gguf_tensor_index, stage_weight_names
from pipellm.model.gguf_linear import GGUF_KERNEL_TYPES
from pipellm.model.llama import LlamaStage
from pipellm.model.rope import RotaryEmbedding
from pipellm.model.stage_spec import StageSpec
from pipellm.model.tp_plan import plan_tensor_parallel

logger = logging.getLogger(__name__)
MIB = 1 << 20
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


class HostMemoryError(RuntimeError):
    """A host has too little memory for the stages placed on it."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds (runtime: measured before loading; the rest: from the model)."""

    weights: int
    kv_cache: int
    workspace: int
    runtime: int

    @property
    def to_load(self) -> int:
        """What loading adds to the running process."""
        return self.weights + self.kv_cache + self.workspace

    @property
    def total(self) -> int:
        return self.runtime + self.to_load

    def describe(self) -> str:
        return (
            f"weights {_mib(self.weights)}, KV cache {_mib(self.kv_cache)}, workspace "
            f"{_mib(self.workspace)}, runtime {_mib(self.runtime)}: {_mib(self.total)}"
        )


@dataclass(frozen=True)
class LoadedStage:
    """A stage once loaded: its plan, and what it holds, measured."""

    name: str
    planned: StageMemory
    weights: int  # the loaded weights' bytes
    resident: int  # the process's resident memory after loading

    def describe(self) -> str:
        return (
            f"{self.name} loaded: weights {_mib(self.weights)}, KV cache "
            f"{_mib(self.planned.kv_cache)}, resident {_mib(self.resident)} (runtime before "
            f"loading {_mib(self.planned.runtime)})"
        )


@dataclass(frozen=True)
class HostLimit:
    """The memory a host's processes may hold together, and what they hold now."""

    limit: int
    in_use: int
    source: str  # where the limit comes from, for the error message

    @property
    def free(self) -> int:
        return max(0, self.limit - self.in_use)


def plan_stage_memory(config: EngineConfig, stage_index: int, tp_rank: int = 0) -> StageMemory:
    """The memory of one stage (or one tensor-parallel rank of it), its runtime measured in
    this process: call it in the stage's process, before loading."""
    return StageMemory(
        weights=stage_weight_bytes(config, stage_index, tp_rank),
        kv_cache=kv_cache_bytes(config, stage_index),
        workspace=workspace_bytes(config),
        runtime=resident_bytes(),
    )


def stage_weight_bytes(config: EngineConfig, stage_index: int, tp_rank: int = 0) -> int:
    """Bytes a stage's (or a tensor-parallel rank's) weights take once loaded, from the
    checkpoint's index alone: GGUF matrices the quantized kernel takes (and the first stage's
    embedding) at their file bytes, everything else in the model's dtype. A tied embedding
    that is also the model's lm_head in one stage counts twice there (the lookup's copy and
    the kernel's packed copy)."""
    mc, spec = config.model_config, config.stage(stage_index)
    tp = plan_tensor_parallel(mc, config.tensor_parallel_size, tp_rank)
    itemsize = config.torch_dtype.itemsize
    sizes = _checkpoint_sizes(config)
    quantized_kinds = GGUF_KERNEL_TYPES if config.quantization.startswith("gguf") else frozenset()
    total = 0
    for name in stage_weight_names(mc, spec, sizes):
        elements, n_bytes, kind = sizes[name]
        shard = tp.weight_shard(name)
        fraction = 1.0 if shard is None else (shard.stop - shard.start) / shard.full
        size = n_bytes if kind in quantized_kinds else elements * itemsize
        both_ends = name == "model.embed_tokens.weight" and spec.is_first and spec.is_last
        total += int(size * fraction) * (2 if both_ends else 1)
    return total


def _checkpoint_sizes(config: EngineConfig) -> dict[str, tuple[int, int, object]]:
    """Hugging Face name -> (elements, bytes as stored, GGUF type or None)."""
    source = config.source
    if source.kind == "gguf" and config.load_format != "dummy":
        return {
            name: (int(np.prod(entry.shape)), entry.n_bytes, entry.tensor_type)
            for name, entry in gguf_tensor_index(source.path, config.model_config).items()
        }
    whole = StageSpec(0, 1, 0, config.model_config.num_hidden_layers)
    model = LlamaStage(config.model_config, whole, config.torch_dtype)
    sizes = {}
    for local_name, parameter in model.named_parameters():
        per_row = parameter.numel() // parameter.shape[0]
        for name, rows in model.checkpoint_shards(local_name):
            sizes[name] = (rows * per_row, rows * per_row * parameter.itemsize, None)
    return sizes


def kv_cache_bytes(config: EngineConfig, stage_index: int) -> int:
    """The stage's layers' share of the pipeline's KV cache (kv_cache_memory is the whole
    pipeline's: every stage holds the same blocks for its own layers, each layer its KV-cache
    group's, model/cache_groups.py)."""
    mc = config.model_config
    spec = config.stage(stage_index)
    groups = config.kv_cache_groups
    blocks = sum(
        groups[mc.layer_cache_group(layer)].num_blocks
        for layer in range(spec.layer_start, spec.layer_end)
    )
    kv_heads = -(-mc.num_key_value_heads // config.tensor_parallel_size)
    per_block = 2 * kv_heads * mc.head_dim * config.block_size
    return blocks * per_block * config.cache_dtype.itemsize


def workspace_bytes(config: EngineConfig) -> int:
    """Activations of the largest micro-batch: per token, the residual stream and the
    normalized copies (4 x hidden), q/k/v, gate/up and their product (3 x intermediate); and
    the logits of every sequence's sampled row. glibc keeps the peak (keep_freed_memory)."""
    mc = config.model_config
    tokens = config.max_num_batched_tokens
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    per_token = 4 * mc.hidden_size + qkv + 3 * mc.intermediate_size
    logits = config.max_num_seqs * mc.vocab_size
    return (tokens * per_token + logits) * config.torch_dtype.itemsize


def loaded_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as loaded: its parameters and the tensors its layers keep
    (packed and quantized weights, biases), buffers (a GGUF embedding's stored rows), each
    storage once; not the RoPE tables."""
    storages: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            continue
        tensors = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def resident_bytes(pid: int | str = "self") -> int:
    """The process's resident memory (Rss of /proc/PID/smaps_rollup: anonymous, file and
    shared pages it has mapped)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/smaps_rollup has no Rss line")


def host_limit() -> HostLimit:
    """This process's host: its memory cgroup's limit where one is set and smaller than the
    machine's memory, else the machine's."""
    meminfo = _meminfo()
    machine = HostLimit(
        meminfo["MemTotal"], meminfo["MemTotal"] - meminfo["MemAvailable"], "physical memory"
    )
    group = _cgroup_limit()
    return group if group is not None and group.limit < machine.limit else machine


def check_host_fits(host: str, stages: dict[str, StageMemory], limit: HostLimit) -> None:
    """Raises HostMemoryError, naming the host, what its stages need and its limit, if what
    they still have to load does not fit beside what the host's processes hold now."""
    need = sum(stage.to_load for stage in stages.values())
    if need <= limit.free:
        return
    parts = "; ".join(f"{name}: {stage.describe()}" for name, stage in stages.items())
    raise HostMemoryError(
        f"out of memory: host {host} cannot hold {', '.join(stages)}: loading needs "
        f"{_mib(need)} ({parts}) but the host's memory limit is {_mib(limit.limit)} "
        f"({limit.source}) and its processes already hold {_mib(limit.in_use)}, which leaves "
        f"{_mib(limit.free)}. Spread the model over more hosts (more pipeline stages, -pp), "
        "lower --kv-cache-memory or --max-num-batched-tokens, or raise the host's limit"
    )


def log_host_memory(host: str, stages: dict[str, StageMemory], limit: HostLimit) -> None:
    """One line a host: its stages' total against its limit, so a user can size machines."""
    total = sum(stage.total for stage in stages.values())
    logger.info(
        "host %s holds %s: %s in all (memory limit %s, %s; %s in use before loading)",
        host,
        ", ".join(stages),
        _mib(total),
        _mib(limit.limit),
        limit.source,
        _mib(limit.in_use),
    )


def _mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


def _meminfo() -> dict[str, int]:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) * 1024
    return values


def _cgroup_limit() -> HostLimit | None:
    """The tightest memory limit on this process's cgroup and its ancestors, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _tightest(
                _CGROUP_ROOT / "memory", path, "memory.limit_in_bytes", cgroup_v1_in_use
            )
    for line in lines:
        if line.startswith("0::"):
            return _tightest(_CGROUP_ROOT, line[3:], "memory.max", _v2_in_use)
    return None


def _tightest(root: Path, path: str, limit_file: str, in_use: object) -> HostLimit | None:
    best = None
    group = root / path.lstrip("/")
    while True:
        try:
            text = (group / limit_file).read_text().strip()
        except OSError:
            text = "max"
        if text != "max" and int(text) < _UNLIMITED and (best is None or int(text) < best.limit):
            best = HostLimit(int(text), in_use(group), f"cgroup {group / limit_file}")
        if group == root or root not in group.parents:
            return best
        group = group.parent


def _stat(group: Path, name: str) -> dict[str, int]:
    values = {}
    for line in (group / name).read_text().splitlines():
        key, value = line.split()
        values[key] = int(value)
    return values


def cgroup_v1_in_use(group: Path) -> int:
    """What a cgroup v1 memory group's processes hold: usage less inactive file cache."""
    usage = int((group / "memory.usage_in_bytes").read_text())
    return max(0, usage - _stat(group, "memory.stat").get("total_inactive_file", 0))


def _v2_in_use(group: Path) -> int:
    usage = int((group / "memory.current").read_text())
    return max(0, usage - _stat(group, "memory.stat").get("inactive_file", 0))
