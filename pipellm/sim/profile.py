"""Sim profiles: JSON files that say how long a stage takes to compute a micro-batch.

A profile is either a hardware description (`"cost_model": "roofline"`) or coefficients
fitted to measured steps (`"cost_model": "linear"`, written by `pipellm profile`); see
pipellm/sim/cost.py for both formulas and docs/simulation.md for every field. The model's
shapes come from the profile's `"model"` (a Hugging Face config.json, inline, or a path
relative to the profile), else from the served model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipellm.model.stage_spec import stage_specs
from pipellm.sim.cost import (
    CorrectedStageCost,
    Hardware,
    LinearCoefficients,
    LinearStageCost,
    Link,
    MeasuredStep,
    Precision,
    RooflineStageCost,
    Serving,
    StageCost,
)
from pipellm.sim.shapes import BatchShape, model_shape

COST_MODELS = ("roofline", "linear")
# Keys a profile may hold beyond its sections; free-form notes for readers.
NOTE_KEYS = {"description", "sources", "assumptions", "fit", "measured_on"}


class ProfileError(ValueError):
    """A profile file is unreadable or malformed; the message names the file and field."""


@dataclass(frozen=True)
class Profile:
    cost_model: str
    link: Link
    serving: Serving = Serving()
    kv_capacity_tokens: int | None = None  # over the whole pipeline; None: from memory
    model: dict[str, Any] | None = None  # Hugging Face config.json of the modelled model
    hardware: Hardware | None = None  # roofline
    precision: Precision | None = None  # roofline
    linear: LinearCoefficients | None = None  # linear
    # linear: fits for one pipeline size each (`pipellm profile` fits every P it times on
    # its own); a pipeline of a size listed here uses that fit instead of `linear`.
    linear_by_stages: dict[int, LinearCoefficients] | None = None
    # concurrent_slowdown[k - 1]: how many times longer a stage step takes while k stages
    # compute at once (stages sharing one machine's cores and memory bandwidth; measured by
    # `pipellm profile`). Beyond the list, its last value. Empty: stages never interfere.
    concurrent_slowdown: tuple[float, ...] = ()
    # linear: the grid `pipellm profile` timed, by (pipeline size, layers, last stage); a
    # stage of that kind has its fitted line pulled toward them (CorrectedStageCost).
    measured_steps: dict[tuple[int, int, bool], tuple[MeasuredStep, ...]] | None = None
    description: str = ""

    def slowdown(self, busy_stages: int) -> float:
        """The factor by which each of `busy_stages` stages computing at once is slowed."""
        factors = self.concurrent_slowdown
        if not factors or busy_stages <= 1:
            return 1.0
        return factors[min(busy_stages, len(factors)) - 1]

    @property
    def stages_interfere(self) -> bool:
        return any(f != 1.0 for f in self.concurrent_slowdown)

    # ---- costs -----------------------------------------------------------------------------

    def stage_costs(self, served_model: dict[str, Any], num_stages: int) -> list[StageCost]:
        """One cost per stage, the model's layers split as the engine splits them."""
        cfg = self.model or served_model
        stages = stage_specs(cfg["num_hidden_layers"], num_stages)
        if self.linear is not None:
            coefficients = (self.linear_by_stages or {}).get(num_stages, self.linear)
            costs: list[StageCost] = []
            for s in stages:
                line = LinearStageCost(s.num_layers, s.is_last, coefficients)
                measured = (self.measured_steps or {}).get((num_stages, s.num_layers, s.is_last))
                costs.append(CorrectedStageCost(line, measured) if measured else line)
            return costs
        assert self.hardware is not None and self.precision is not None
        shape = model_shape(cfg)
        return [
            RooflineStageCost(
                tuple(shape.layers[s.layer_start : s.layer_end]),
                shape.head_params if s.is_last else 0,
                self.hardware,
                self.precision,
            )
            for s in stages
        ]

    def link_terms(self, served_model: dict[str, Any]) -> tuple[float, float]:
        """(latency, seconds per token) of the link between consecutive stages: a
        micro-batch's hidden states reach the next stage latency + tokens x that later."""
        hidden = (self.model or served_model)["hidden_size"]
        activation_bytes = self.precision.activation_bytes if self.precision else 4.0
        return self.link.latency_s, hidden * activation_bytes / self.link.bytes_per_s

    def kv_capacity(self, served_model: dict[str, Any], num_stages: int) -> int | None:
        """Tokens of KV cache the pipeline holds: stated, or what the fullest stage's device
        has left after its weights; None if the profile says neither."""
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        hw = self.hardware
        if hw is None or hw.memory_bytes is None or self.precision is None:
            return None
        capacity = None
        for cost in self.stage_costs(served_model, num_stages):
            assert isinstance(cost, RooflineStageCost)
            free = hw.memory_bytes * hw.memory_utilization - cost.weight_bytes()
            per_token = sum(layer.kv_elements_per_token for layer in cost.layers)
            tokens = int(free / (per_token * self.precision.kv_bytes))
            capacity = tokens if capacity is None else min(capacity, tokens)
        if capacity is not None and capacity <= 0:
            raise ProfileError("the stage's weights do not fit its memory_bytes")
        return capacity


# ---- reading ---------------------------------------------------------------------------------


def load_profile(path: str | Path) -> Profile:
    """Reads and checks a profile; raises ProfileError naming the file and the bad field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ProfileError(f"sim profile {path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"sim profile {path}: not valid JSON ({error})") from None
    try:
        return profile_from_dict(data, path.parent)
    except ProfileError as error:
        raise ProfileError(f"sim profile {path}: {error}") from None


def profile_from_dict(data: Any, base_dir: Path = Path(".")) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError("the top level must be a JSON object")
    kind = data.get("cost_model")
    if kind not in COST_MODELS:
        raise ProfileError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {kind!r}")
    sections = {"cost_model", "link", "serving", "kv_capacity_tokens", "model"}
    sections.add("concurrent_slowdown")
    sections |= (
        {"hardware", "precision"}
        if kind == "roofline"
        else {"linear", "linear_by_stages", "measured_steps"}
    )
    unknown = sorted(set(data) - sections - NOTE_KEYS)
    if unknown:
        raise ProfileError(f"unknown field(s) {unknown} for cost_model {kind!r}")
    model = data.get("model")
    if isinstance(model, str):
        model_path = base_dir / model
        try:
            model = json.loads(model_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ProfileError(f"model: cannot read {model_path} ({error})") from None
    if model is not None:
        try:
            model_shape(model)  # every needed field is there
        except (ValueError, TypeError) as error:
            raise ProfileError(f"model: {error}") from None
    capacity = data.get("kv_capacity_tokens")
    if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
        raise ProfileError(f"kv_capacity_tokens must be a positive integer, got {capacity!r}")
    slowdown = data.get("concurrent_slowdown", [])
    if not isinstance(slowdown, list) or not all(
        isinstance(f, int | float) and f > 0 for f in slowdown
    ):
        raise ProfileError(
            "concurrent_slowdown must be a list of numbers > 0 (the slowdown with 1, 2, ... "
            f"stages computing at once), got {slowdown!r}"
        )
    profile = Profile(
        cost_model=kind,
        concurrent_slowdown=tuple(float(f) for f in slowdown),
        link=_section(data, "link", Link, required=False),
        serving=_section(data, "serving", Serving, required=False),
        kv_capacity_tokens=capacity,
        model=model,
        description=str(data.get("description", "")),
    )
    if kind == "linear":
        linear = _section(data, "linear", LinearCoefficients, required=True)
        by_stages = data.get("linear_by_stages", {})
        if not isinstance(by_stages, dict) or not all(
            key.isdigit() and int(key) > 0 for key in by_stages
        ):
            raise ProfileError(
                "linear_by_stages must be an object keyed by pipeline size ('1', '2', ...), "
                f"got {by_stages!r}"
            )
        fits = {
            int(key): _section(
                by_stages, key, LinearCoefficients, required=True, name=f"linear_by_stages.{key}"
            )
            for key in by_stages
        }
        return Profile(
            **{
                **_as_kwargs(profile),
                "linear": linear,
                "linear_by_stages": fits,
                "measured_steps": _measured_steps(data.get("measured_steps", [])),
            }
        )
    hardware = _section(data, "hardware", Hardware, required=True)
    if hardware.flops_per_s <= 0 or hardware.bytes_per_s <= 0:
        raise ProfileError("hardware: flops_per_s and bytes_per_s must be positive")
    precision = _section(data, "precision", Precision, required=True)
    return Profile(**{**_as_kwargs(profile), "hardware": hardware, "precision": precision})


_STEP_SHAPE = ("num_tokens", "num_requests", "num_sampled", "attention_pairs", "context_tokens")
_STEP_KEYS = ("pipeline_parallel_size", "layers", "last_stage", *_STEP_SHAPE, "measured_s")


def _measured_steps(data: Any) -> dict[tuple[int, int, bool], tuple[MeasuredStep, ...]]:
    """measured_steps: a list of {pipeline_parallel_size, layers, last_stage, the BatchShape
    fields, measured_s} (other keys, such as fitted_s, are notes)."""
    if not isinstance(data, list):
        raise ProfileError(f"measured_steps must be a list, got {type(data).__name__}")
    by_kind: dict[tuple[int, int, bool], list[MeasuredStep]] = {}
    for i, step in enumerate(data):
        missing = [k for k in _STEP_KEYS if not isinstance(step, dict) or k not in step]
        if missing:
            raise ProfileError(f"measured_steps[{i}]: missing {', '.join(missing)}")
        values = [step[k] for k in _STEP_KEYS if k != "last_stage"]
        if not all(isinstance(v, int | float) and v >= 0 for v in values) or not isinstance(
            step["last_stage"], bool
        ):
            raise ProfileError(
                f"measured_steps[{i}]: numbers >= 0 and a true/false last_stage, got {step!r}"
            )
        if step["measured_s"] <= 0 or step["num_tokens"] <= 0:
            raise ProfileError(f"measured_steps[{i}]: measured_s and num_tokens must be > 0")
        shape = BatchShape(**{k: step[k] for k in _STEP_SHAPE})
        kind = (int(step["pipeline_parallel_size"]), int(step["layers"]), step["last_stage"])
        by_kind.setdefault(kind, []).append(MeasuredStep(shape, float(step["measured_s"])))
    return {kind: tuple(steps) for kind, steps in by_kind.items()}


def _as_kwargs(profile: Profile) -> dict[str, Any]:
    return {f.name: getattr(profile, f.name) for f in fields(profile)}


def _section(
    data: dict[str, Any], key: str, cls: type, required: bool, name: str | None = None
) -> Any:
    """data[key] as a cls; errors call it `name` (default: key)."""
    section = data.get(key)
    name = name or key
    if section is None:
        if required:
            raise ProfileError(f"the {name!r} section is missing")
        return cls()
    if not isinstance(section, dict):
        raise ProfileError(f"{name} must be a JSON object")
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ProfileError(f"{name}: unknown field(s) {unknown}; known: {', '.join(allowed)}")
    for key, value in section.items():
        if not isinstance(value, int | float) or value < 0:
            raise ProfileError(f"{name}.{key} must be a number >= 0, got {value!r}")
    try:
        return cls(**section)
    except TypeError as error:  # a required field is missing
        raise ProfileError(f"{name}: {error}") from None
