"""A pipeline stage's place in the model: its index among P stages, its layers, and whether it
embeds tokens (first) or computes logits (last). The model, the weight loader, the workers and
the sim backend's cost model all take it from here."""

from __future__ import annotations

import os
from dataclasses import dataclass

PARTITION_ENV = "PIPELLM_PP_LAYER_PARTITION"


@dataclass(frozen=True)
class StageSpec:
    index: int  # 0 .. num_stages - 1, in pipeline order
    num_stages: int  # P
    layer_start: int  # the stage runs global layers [layer_start, layer_end)
    layer_end: int

    @property
    def is_first(self) -> bool:
        """Embeds the input tokens."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Runs the final norm and lm_head, and samples."""
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @classmethod
    def whole_model(cls, num_layers: int) -> StageSpec:
        """The one stage of an unpipelined model."""
        return cls(0, 1, 0, num_layers)


def stage_specs(num_layers: int, num_stages: int) -> list[StageSpec]:
    """Contiguous layer ranges, as even as possible.

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
    specs, start = [], 0
    for index, size in enumerate(sizes):
        specs.append(StageSpec(index, num_stages, start, start + size))
        start += size
    return specs
