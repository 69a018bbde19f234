"""Which layers each pipeline stage owns."""

from __future__ import annotations

import os

PARTITION_ENV = "PIPELLM_PP_LAYER_PARTITION"


def partition_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, as even as possible.

    The remainder goes to the *first* stages: the last stage also runs the final norm,
    lm_head and sampling. `PIPELLM_PP_LAYER_PARTITION="16,14"` sets the sizes explicitly.
    """
    override = os.environ.get(PARTITION_ENV)
    if override:
        sizes = [int(s) for s in override.split(",")]
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) <= 0:
            raise ValueError(
                f"{PARTITION_ENV}={override!r} must list {num_stages} positive layer counts "
                f"that add up to {num_layers}"
            )
    else:
        if num_stages > num_layers:
            raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (stage < extra) for stage in range(num_stages)]
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges
