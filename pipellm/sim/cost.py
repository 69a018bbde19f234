"""Step time of one micro-batch on one stage: a roofline of hardware, or a fitted line.

Roofline (hardware described, docs/simulation.md):
    time = step_overhead + max(GEMM FLOPs / flops_per_s + attention FLOPs / attention_flops_per_s,
                               bytes read / bytes_per_s)
where the bytes are the stage's dense weights, the routed experts the batch touches, the KV
cache its requests attend to, and (last stage) the lm_head.

Linear (measured on this machine by `pipellm profile`, or written by hand):
    time = step_s + L (layer_s + layer_token_s T + layer_request_s R + layer_pair_s A
                       + layer_context_s C)
           [+ head_s + head_sampled_s S on the last stage]
for L layers, T tokens, R requests, A attention pairs, C context tokens (the KV cache the
batch's requests read) and S sampled rows.

Measured steps (a measured profile's grid, each shape's median time): a line cannot follow
every kernel regime (an AVX2 CPU's GEMMs keep 1-4 rows in registers and take more through a
buffer, so 4-row decodes sat 12-18% below the line and 8-row ones 12% above it), so the line
is pulled toward the times measured at nearby shapes:
    time = line(b) x exp(sum_j w_j ln(measured_j / line(b_j)) / (W0 + sum_j w_j))
    w_j = exp(-d_j^2 / 2), d_j = |f(b) - f(b_j)| / SCALE, f(b) = ln(1 + (T, R, A, C))
At a measured shape the time is within a few percent of its measurement; two shapes apart by
more than ~3 x SCALE in every feature (about 2.5x in one of them) do not pull each other, and
far from every measured shape the line stands.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from pipellm.sim.shapes import BatchShape, LayerShape


class StageCost(Protocol):
    def seconds(self, batch: BatchShape) -> float:
        """Seconds the stage computes this micro-batch."""
        ...


@dataclass(frozen=True)
class LinearCoefficients:
    step_s: float = 0.0
    layer_s: float = 0.0
    layer_token_s: float = 0.0
    layer_request_s: float = 0.0
    layer_pair_s: float = 0.0
    # Per context token whose cached K/V a layer reads. A decode row attends to its whole
    # context with one query: a memory-bound read of the paged cache, not the compute-bound
    # SDPA of a prompt chunk that layer_pair_s measures (one query token per pair).
    layer_context_s: float = 0.0
    head_s: float = 0.0
    head_sampled_s: float = 0.0


@dataclass(frozen=True)
class LinearStageCost:
    num_layers: int
    is_last: bool
    c: LinearCoefficients

    def seconds(self, batch: BatchShape) -> float:
        c = self.c
        per_layer = (
            c.layer_s
            + c.layer_token_s * batch.num_tokens
            + c.layer_request_s * batch.num_requests
            + c.layer_pair_s * batch.attention_pairs
            + c.layer_context_s * batch.context_tokens
        )
        head = c.head_s + c.head_sampled_s * batch.num_sampled if self.is_last else 0.0
        return c.step_s + self.num_layers * per_layer + head


@dataclass(frozen=True)
class MeasuredStep:
    """One shape `pipellm profile` timed on a stage, and its median seconds."""

    shape: BatchShape
    seconds: float


# How far a measured shape reaches (natural-log units of its features: 0.3 is ~35%), and how
# strongly the line holds where no measured shape is near (the weight of "no correction").
MEASURED_SCALE = 0.3
LINE_WEIGHT = 0.05
_FAR = 18.0  # d^2 beyond which a shape's weight (< 1.3e-4) is not worth adding


def _features(batch: BatchShape) -> tuple[float, float, float, float]:
    return (
        math.log1p(batch.num_tokens) / MEASURED_SCALE,
        math.log1p(batch.num_requests) / MEASURED_SCALE,
        math.log1p(batch.attention_pairs) / MEASURED_SCALE,
        math.log1p(batch.context_tokens) / MEASURED_SCALE,
    )


@dataclass(frozen=True)
class CorrectedStageCost:
    """A fitted stage cost pulled toward the times measured near a shape (formula above)."""

    line: StageCost
    measured: tuple[MeasuredStep, ...]

    @cached_property
    def _points(self) -> list[tuple[tuple[float, ...], float]]:
        return [
            (_features(m.shape), math.log(m.seconds / self.line.seconds(m.shape)))
            for m in self.measured
        ]

    @cached_property
    def _memo(self) -> dict[BatchShape, float]:
        return {}

    def seconds(self, batch: BatchShape) -> float:
        factor = self._memo.get(batch)
        if factor is None:
            f = _features(batch)
            pulled, weights = 0.0, LINE_WEIGHT
            for g, log_ratio in self._points:
                d2 = sum((a - b) ** 2 for a, b in zip(f, g, strict=True))
                if d2 < _FAR:
                    w = math.exp(-d2 / 2)
                    pulled += w * log_ratio
                    weights += w
            factor = self._memo[batch] = math.exp(pulled / weights)
        return self.line.seconds(batch) * factor


@dataclass(frozen=True)
class Hardware:
    """One stage's device. FLOP/s and bandwidth are what a step achieves, not marketing peaks,
    unless the profile says otherwise (docs/simulation.md)."""

    flops_per_s: float  # GEMMs at the weights' precision
    bytes_per_s: float  # device memory
    step_overhead_s: float = 0.0  # launch and framework time of one stage step
    attention_flops_per_s: float | None = None  # default: flops_per_s
    memory_bytes: float | None = None  # per device: with memory_utilization, the KV capacity
    memory_utilization: float = 0.9


@dataclass(frozen=True)
class Link:
    """Between consecutive stages: each micro-batch's hidden states cross it."""

    latency_s: float = 0.0
    bytes_per_s: float = math.inf
    # The engine's submit -> the first stage starts (scheduling, serializing, IPC); it
    # delays every micro-batch, and the stage idles if nothing else is queued.
    dispatch_s: float = 0.0


@dataclass(frozen=True)
class Serving:
    """The serving path around the engine, as `pipellm simulate` models it."""

    request_latency_s: float = 0.0  # a client's send -> the engine has it (HTTP, tokenizing)
    output_latency_s: float = 0.0  # the engine emits a token -> the client has it
    send_interval_s: float = 0.0  # the client sends one request at a time, this far apart


@dataclass(frozen=True)
class Precision:
    """Bytes per stored value."""

    weight_bytes: float  # decoder layers' parameters
    head_bytes: float  # lm_head
    kv_bytes: float  # one cached KV element
    activation_bytes: float = 2.0  # hidden states sent between stages


@dataclass(frozen=True)
class RooflineStageCost:
    layers: tuple[LayerShape, ...]
    head_params: int  # 0 except on the last stage
    hw: Hardware
    precision: Precision

    @cached_property
    def _sums(self) -> tuple[float, float, float, float, tuple[tuple[int, LayerShape], ...]]:
        """Per-token GEMM FLOPs, FLOPs per attention pair, always-read parameters and KV
        elements per context token, summed over the stage's layers; and its routed-expert
        layers grouped by shape (count, layer). The simulation evaluates a stage's cost once
        per micro-batch, so the sums over ~8 layers are done once, not per step."""
        groups = Counter(layer for layer in self.layers if layer.num_experts)
        return (
            sum(
                2 * (layer.dense_params + layer.experts_per_token * layer.expert_params)
                for layer in self.layers
            ),
            sum(layer.attention_flops_per_pair for layer in self.layers),
            sum(layer.dense_params for layer in self.layers),
            sum(layer.kv_elements_per_token for layer in self.layers),
            tuple((count, layer) for layer, count in groups.items()),
        )

    @cached_property
    def _per_tokens(self) -> dict[int, tuple[float, float]]:
        """Memo: a micro-batch size's GEMM seconds and bytes read that do not depend on its
        requests (weights, experts touched, lm_head). Sizes repeat (every decode step of one
        request has 1 token), so each is worked out once."""
        return {}

    def _token_terms(self, tokens: int) -> tuple[float, float]:
        hw, p = self.hw, self.precision
        gemm_per_token, _, dense_params, _, expert_groups = self._sums
        params_read = dense_params + sum(
            count * layer.expected_experts_touched(tokens) * layer.expert_params
            for count, layer in expert_groups
        )
        bytes_read = params_read * p.weight_bytes + self.head_params * p.head_bytes
        return tokens * gemm_per_token / hw.flops_per_s, bytes_read

    def seconds(self, batch: BatchShape) -> float:
        hw, p = self.hw, self.precision
        memo = self._per_tokens
        terms = memo.get(batch.num_tokens)
        if terms is None:
            terms = memo[batch.num_tokens] = self._token_terms(batch.num_tokens)
        compute, bytes_read = terms
        _, flops_per_pair, _, kv_elements, _ = self._sums
        compute += 2 * batch.num_sampled * self.head_params / hw.flops_per_s
        bytes_read += kv_elements * batch.context_tokens * p.kv_bytes
        compute += (
            flops_per_pair * batch.attention_pairs / (hw.attention_flops_per_s or hw.flops_per_s)
        )
        return hw.step_overhead_s + max(compute, bytes_read / hw.bytes_per_s)

    def weight_bytes(self) -> float:
        """Bytes of the stage's weights held on its device (every expert)."""
        params = sum(
            layer.dense_params + layer.num_experts * layer.expert_params for layer in self.layers
        )
        return params * self.precision.weight_bytes + self.head_params * self.precision.head_bytes
