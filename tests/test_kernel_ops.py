"""The Python side of the kernel library's ops (pipellm/kernels/kernel_ops.py): a wrapper for
every op the library registers, each taking the op's parameters by name and in order, so a
changed op fails here rather than in one of its callers."""

from __future__ import annotations

import inspect

import pytest
import torch

from pipellm.kernels.kernel_ops import KernelOps


def registered_ops(namespace: str) -> dict[str, list[str]]:
    """Each op of `namespace` (torch.ops.<namespace>): its schema's argument names."""
    prefix = f"{namespace}::"
    return {
        schema.name.removeprefix(prefix): [argument.name for argument in schema.arguments]
        for schema in torch._C._jit_get_all_schemas()
        if schema.name.startswith(prefix)
    }


def op_wrappers() -> dict[str, list[str]]:
    """KernelOps' op methods (not the decode_* class factories): their parameters."""
    methods = inspect.getmembers(KernelOps, inspect.isfunction)
    return {
        name: list(inspect.signature(method).parameters)[1:]  # without self
        for name, method in methods
        if not name.startswith(("_", "decode_"))
    }


def test_every_registered_op_has_a_wrapper_with_its_parameters(kernel_ops):
    schemas = registered_ops(f"pipellm_{kernel_ops.level}")
    # Both the kernels and the shared-memory collectives built into the same library.
    assert {"packed_linear", "gguf_linear", "shm_all_reduce_", "shm_broadcast_recv"} <= set(schemas)
    assert op_wrappers() == schemas


def test_the_fused_decode_path_classes_take_fields_by_name(kernel_ops):
    linear = kernel_ops.decode_linear()
    linear.method, linear.out_features, linear.types = 3, 8, [2, 8]
    assert (linear.method, linear.out_features, linear.types) == (3, 8, [2, 8])
    layer = kernel_ops.decode_layer()
    layer.qkv_proj, layer.window = linear, 4
    assert layer.qkv_proj.types == [2, 8] and layer.window == 4
    with pytest.raises(RuntimeError, match="widow"):
        layer.widow = 4  # a misspelt field is an error, not a new attribute
