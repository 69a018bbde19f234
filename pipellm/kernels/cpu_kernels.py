"""Builds and loads pipellm's C++ CPU kernels, one library per instruction-set level, and picks
the best level the CPU it runs on offers (runtime dispatch).

Every kernel source is compiled once per level (`LEVELS`: AVX2 + FMA, then AVX-512 F/BW/VL/DQ)
into its own library, `pipellm_cpu_kernels_<level>`, whose ops live in their own namespace,
`torch.ops.pipellm_<level>.*`. At load time pipellm reads the CPU's feature flags, takes the
highest level it supports (or the one PIPELLM_CPU_ISA names), builds that library on first use
with torch's JIT extension builder (g++ and ninja, ~1 min on 2 cores) and caches it under torch's
extensions folder ($TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions). So one install
runs the best code on whichever x86-64 machine it lands on, the same way oneDNN and
llama.cpp's GGML_CPU_ALL_VARIANTS builds choose their code paths. Callers take their ops from
`ops()`, never from a fixed namespace: a KernelOps (kernel_ops.py), which holds every op's
Python wrapper and signature.

A new kernel source joins by being added to `SOURCES`: it includes "kernel_library.h",
declares its ops in kernel_ops.h (C++) and kernel_ops.py (Python), defines them as
`pipellm_ops::NAME` and registers them with `PIPELLM_LIBRARY_FRAGMENT(m)`; it is then built
for every level, and a source that has nothing level-specific simply compiles to the same
code at each. Sources test `__AVX512F__` (etc.) to specialise. The tensor-parallel group's
shared-memory collectives (pipellm/parallel/shm_comm.cpp) are built into the same library.

Where no level can be built or run (not x86-64 with AVX2, no compiler) pipellm logs why and
keeps its pure-PyTorch path. PIPELLM_CPU_KERNELS=0 turns the kernels off, e.g. to compare the
two paths; PIPELLM_CPU_ISA=avx2 (or any name in LEVELS) forces a level the CPU supports.
`make install` builds the levels this CPU runs: `python -m pipellm.kernels.cpu_kernels`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pipellm.kernels.kernel_ops import KernelOps

logger = logging.getLogger(__name__)

_FILES = (
    "paged_decode_attention.cpp",
    "prefill_attention.cpp",
    "packed_linear.cpp",
    "quantized_linear.cpp",
    "int8_linear.cpp",
    "rotary_and_cache.cpp",
    "elementwise.cpp",
    "decode_layers.cpp",
    "gguf_type_table.cpp",
    "gguf_legacy_quants.cpp",
    "gguf_k_quants.cpp",
    "gguf_iq_quants.cpp",
    "gguf_float_types.cpp",
    "gguf_linear.cpp",
    "panel_rows.cpp",
)
_KERNELS_DIR = Path(__file__).parent
# The tensor-parallel group's shared-memory collectives join the same build (and the fused
# decode path calls them directly), though they live beside the Python that uses them.
SOURCES = [_KERNELS_DIR / name for name in _FILES] + [
    _KERNELS_DIR.parent / "parallel" / "shm_comm.cpp"
]
# Head sizes the attention kernel is instantiated for (see attend_for in the source).
DECODE_ATTENTION_HEAD_DIMS = frozenset({16, 32, 64, 80, 96, 128, 256})
# KV-cache dtypes the attention kernels read and write (float16 through F16C).
KERNEL_CACHE_DTYPES = frozenset({torch.float32, torch.float16})
_DISABLE_ENV = "PIPELLM_CPU_KERNELS"
LEVEL_ENV = "PIPELLM_CPU_ISA"


@dataclass(frozen=True)
class IsaLevel:
    """One instruction-set level: the /proc/cpuinfo flags a CPU needs to run it and the
    compiler flags that build it."""

    name: str
    cpu_flags: frozenset[str]
    cflags: tuple[str, ...]

    @property
    def namespace(self) -> str:
        return f"pipellm_{self.name}"


# Lowest first. Not -march=native: a cached build may be loaded on another machine of the level.
LEVELS = (
    IsaLevel("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    IsaLevel(
        "avx512",
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    ),
)
_BY_NAME = {level.name: level for level in LEVELS}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU as Linux reports them (the kernel leaves out AVX-512 where
    the OS does not save its registers); empty where /proc/cpuinfo is not there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _flags_from_torch() -> frozenset[str]:
    """A fallback where /proc/cpuinfo is missing: what torch's own dispatch detected."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = {"avx2", "fma", "f16c"} if capability in ("AVX2", "AVX512") else set()
    if capability == "AVX512":
        flags |= {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    return frozenset(flags)


def supported_levels() -> list[str]:
    """The levels this CPU can run, lowest first (empty off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    flags = cpu_flags() or _flags_from_torch()
    return [level.name for level in LEVELS if level.cpu_flags <= flags]


def _requested_level() -> str | None:
    """The level PIPELLM_CPU_ISA forces, or None for the best one; a bad value is an error."""
    value = os.environ.get(LEVEL_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _BY_NAME:
        raise ValueError(
            f"{LEVEL_ENV}={value!r} is not a kernel level; use one of "
            f"{', '.join(_BY_NAME)} or 'auto' (the best this CPU supports)"
        )
    if value not in supported_levels():
        raise ValueError(
            f"{LEVEL_ENV}={value!r}: this CPU does not support it (it supports "
            f"{', '.join(supported_levels()) or 'none'}); unset it or pick one of those"
        )
    return value


def why_unavailable() -> str | None:
    """None if the kernels can be built here and are not turned off, else the reason."""
    if os.environ.get(_DISABLE_ENV, "1") == "0":
        return f"turned off by {_DISABLE_ENV}=0"
    return why_unbuildable()


def why_unbuildable() -> str | None:
    """None if this machine can build and run the kernel library, else why not (whatever
    PIPELLM_CPU_KERNELS says: the shared-memory collectives in it serve tensor parallelism
    even where the compute kernels are turned off)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"written for x86-64, this is {platform.machine()}"
    if not supported_levels():
        return (
            f"they need AVX2 + FMA + F16C, the CPU offers {torch.backends.cpu.get_cpu_capability()}"
        )
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found"
    return None


def chosen_level() -> str:
    """The level the kernels run at here: PIPELLM_CPU_ISA's, else the best the CPU supports."""
    return _requested_level() or supported_levels()[-1]


@functools.cache
def cpu_kernels_available() -> bool:
    """Builds (or loads the cached build of) the chosen level's kernels; False, logged once,
    where it can't."""
    reason = why_unavailable()
    if reason is not None:
        logger.info("pipellm CPU kernels not used (%s); using the PyTorch path", reason)
        return False
    level = chosen_level()  # a bad PIPELLM_CPU_ISA raises: a wrong setting is not a fallback
    try:
        _load(level)
    except Exception as error:  # a failed build must not stop the engine: fall back
        logger.warning(
            "pipellm CPU kernels (%s) failed to build (%s); using the slower PyTorch path",
            level,
            error,
        )
        return False
    logger.info(
        "pipellm CPU kernels: %s (this CPU supports %s; %s forces one)",
        level,
        ", ".join(supported_levels()),
        LEVEL_ENV,
    )
    return True


def ops(level: str | None = None) -> KernelOps:
    """The kernels' ops at `level` (default: the chosen one), built or loaded on first use."""
    return _ops_at(level or _chosen_loaded())


@functools.cache
def _ops_at(name: str) -> KernelOps:
    if name not in supported_levels():
        raise ValueError(
            f"kernel level {name!r} is not one this CPU supports ({', '.join(supported_levels())})"
        )
    _load(name)
    namespace = _BY_NAME[name].namespace
    return KernelOps(name, getattr(torch.ops, namespace), getattr(torch.classes, namespace))


@functools.cache
def _chosen_loaded() -> str:
    if not cpu_kernels_available():
        raise RuntimeError(f"pipellm CPU kernels are not available here: {why_unavailable()}")
    return chosen_level()


def int8_activations_unavailable() -> str | None:
    """None if the int8-activation GEMM (`quantization="gguf_int8"`, int8_linear.cpp) runs
    here, else why not: it needs pipellm's kernels (any level: AVX-512 VNNI's vpdpbusd where
    the CPU has it, else AVX2's vpmaddubsw + vpmaddwd, bit-identical)."""
    reason = why_unavailable()
    if reason is not None:
        return f"pipellm's CPU kernels are not used ({reason})"
    return None


def kernels_apply(x: torch.Tensor) -> bool:
    """Whether the kernels can take x: a float32 CPU tensor, on a machine where they built."""
    return x.is_cpu and x.dtype == torch.float32 and cpu_kernels_available()


@functools.cache
def _load(name: str) -> None:
    from pipellm.kernels.extension_build import load_extension

    level = _BY_NAME[name]
    load_extension(
        f"pipellm_cpu_kernels_{level.name}",
        sources=[str(p) for p in SOURCES],
        extra_include_paths=[str(_KERNELS_DIR)],
        extra_cflags=[
            "-O3",
            *level.cflags,
            "-fopenmp",
            # Each level's library keeps its symbols to itself: no inline helper of one level
            # may bind to another level's copy.
            "-fvisibility=hidden",
            "-fvisibility-inlines-hidden",
            f"-DPIPELLM_OPS_NAMESPACE={level.namespace}",
        ],
        extra_ldflags=["-fopenmp", "-lrt"],  # -lrt: shm_open where glibc is older than 2.34
        verbose=False,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ready = cpu_kernels_available()
    for name in supported_levels():  # later processes may force any of them
        ops(name)
    print("pipellm CPU kernels:", f"ready, {chosen_level()}" if ready else "not used")
