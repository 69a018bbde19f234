"""Builds and loads pipellm's C++ CPU kernels (torch.ops.pipellm.*) once per process.

The sources are compiled on first use with torch's JIT extension builder (g++ and ninja,
~20 s) and cached under torch's extensions folder ($TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), so later processes only load the library. `make install` builds
them up front: `python -m pipellm.kernels.cpu_kernels`.

Where they cannot be built (not x86-64 with AVX2, no compiler) pipellm logs why and keeps its
pure-PyTorch path. PIPELLM_CPU_KERNELS=0 turns them off, e.g. to compare the two paths.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_FILES = (
    "paged_decode_attention.cpp",
    "prefill_attention.cpp",
    "packed_linear.cpp",
    "quantized_linear.cpp",
    "rotary_and_cache.cpp",
    "elementwise.cpp",
)
SOURCES = [Path(__file__).with_name(name) for name in _FILES]
# Head sizes the attention kernel is instantiated for (see attend_for in the source).
DECODE_ATTENTION_HEAD_DIMS = frozenset({16, 32, 64, 80, 96, 128})
_DISABLE_ENV = "PIPELLM_CPU_KERNELS"


def why_unavailable() -> str | None:
    """None if the kernels can be built here, else the reason they cannot."""
    if os.environ.get(_DISABLE_ENV, "1") == "0":
        return f"turned off by {_DISABLE_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"written for x86-64, this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"they need AVX2, the CPU offers {capability}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found"
    return None


@functools.cache
def cpu_kernels_available() -> bool:
    """Builds (or loads the cached build of) the kernels; False, logged once, where it can't."""
    reason = why_unavailable()
    if reason is not None:
        logger.info("pipellm CPU kernels not used (%s); using the PyTorch path", reason)
        return False
    try:
        _load()
        return True
    except Exception as error:  # a failed build must not stop the engine: fall back
        logger.warning(
            "pipellm CPU kernels failed to build (%s); using the slower PyTorch path", error
        )
        return False


def kernels_apply(x: torch.Tensor) -> bool:
    """Whether the kernels can take x: a float32 CPU tensor, on a machine where they built."""
    return x.is_cpu and x.dtype == torch.float32 and cpu_kernels_available()


def _load() -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(
        name="pipellm_cpu_kernels",
        sources=[str(p) for p in SOURCES],
        # Not -march=native: a cached build may be loaded on another AVX2 machine.
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("pipellm CPU kernels:", "ready" if cpu_kernels_available() else "not used")
