"""pipellm: an LLM serving engine whose pipeline parallelism really runs in parallel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from pipellm.engine.outputs import CompletionOutput, RequestOutput
    from pipellm.llm import LLM
    from pipellm.sampling_params import SamplingParams
    from pipellm.structured_outputs import StructuredOutputsParams

_LAZY = {
    "LLM": "pipellm.llm",
    "SamplingParams": "pipellm.sampling_params",
    "StructuredOutputsParams": "pipellm.structured_outputs",
    "RequestOutput": "pipellm.engine.outputs",
    "CompletionOutput": "pipellm.engine.outputs",
}


def __getattr__(name: str) -> Any:
    # NOTE: lazy so that `pipellm bench serve` (HTTP only) starts without importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipellm' has no attribute {name!r}")
