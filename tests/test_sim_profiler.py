"""`pipellm profile`: the fit recovers a known cost model, and the command writes a profile
the sim backend loads."""

import json

import pytest

from pipellm.entrypoints.cli import build_parser
from pipellm.protocol import ScheduledRequest, SchedulerOutput
from pipellm.sim.cost import LinearCoefficients, LinearStageCost
from pipellm.sim.profile import load_profile
from pipellm.sim.profiler import DECODE_GRID, PREFILL_GRID, Sample, fit, grid
from pipellm.sim.shapes import BatchShape
from tests.checkpoints import make_tiny_checkpoint


def grid_batch(chunks: list[tuple[int, int]]) -> BatchShape:
    requests = [
        ScheduledRequest(str(i), c, n, [], [], sample=True) for i, (c, n) in enumerate(chunks)
    ]
    return BatchShape.of(SchedulerOutput(0, requests))


def test_fit_recovers_the_coefficients_it_was_made_from():
    truth = LinearCoefficients(
        step_s=2e-3, layer_s=1e-3, layer_token_s=5e-5, layer_request_s=1e-5,
        layer_pair_s=1e-8, layer_context_s=3e-8, head_s=4e-3, head_sampled_s=2e-4,
    )  # fmt: skip
    samples = [
        Sample(layers, last, batch, LinearStageCost(layers, last, truth).seconds(batch))
        for layers, last in ((30, True), (15, False), (15, True))
        for batch in map(grid_batch, DECODE_GRID + PREFILL_GRID)
    ]
    fitted, errors = fit(samples)
    assert max(abs(e) for e in errors) < 1e-6
    for name, value in vars(truth).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-4), name


def test_no_coefficient_is_negative():
    """Times that fall with more work (noise) must not give a negative term."""
    samples = [
        Sample(4, True, grid_batch([(0, tokens)]), seconds)
        for tokens, seconds in ((1, 0.010), (64, 0.009), (128, 0.020))
    ]
    fitted, _ = fit(samples)
    assert min(vars(fitted).values()) >= 0


def test_profile_command_writes_a_loadable_profile(tmp_path, capsys):
    """Default timing: every grid point streamed through the engine's own executor (P=1 in
    process, P=2 the mp backend's stage processes), a fit per P, no slowdown factor."""
    model = make_tiny_checkpoint(tmp_path / "tiny")
    output = tmp_path / "profile.json"
    args = build_parser().parse_args(
        ["profile", str(model), "--output", str(output), "--repeats", "1"]
    )
    args.func(args)
    assert "fit error: mean" in capsys.readouterr().out
    profile = load_profile(output)
    assert profile.cost_model == "linear" and profile.link.dispatch_s > 0
    data = json.loads(output.read_text())
    points = grid(512)  # the tiny model's context leaves out the longest grid points
    assert 0 < len(points) < len(DECODE_GRID + PREFILL_GRID)
    assert len(data["measured_steps"]) == 3 * len(points)  # every stage of P=1 and P=2
    assert all(s["measured_s"] > 0 for s in data["measured_steps"])
    assert len(profile.measured_steps) == 3  # (P, layers, last stage): P=1 and P=2's two stages
    assert set(data["linear_by_stages"]) == {"1", "2"}
    assert set(profile.linear_by_stages) == {1, 2}
    assert data["measured_on"]["timing"] == "stream" and data["concurrent_slowdown"] == []
    assert not profile.stages_interfere
    # The hand-over, from the streamed micro-batches' timestamps: P=2 sets the link, and
    # dispatch_s is the engine loop plus P=2's submit -> stage 0 and last stage -> result.
    hand_over = data["fit"]["hand_over"]
    assert set(hand_over) == {"1", "2"} and hand_over["1"]["latency_s"] == 0
    assert profile.link.latency_s == hand_over["2"]["latency_s"] >= 0
    expected = data["fit"]["engine_loop_s"] + hand_over["2"]["dispatch_s"]
    assert profile.link.dispatch_s == pytest.approx(expected)


def test_profile_alone_timing_measures_the_concurrent_slowdown(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny")
    output = tmp_path / "profile.json"
    args = build_parser().parse_args(
        ["profile", str(model), "--output", str(output), "--repeats", "1", "--timing", "alone"]
    )
    args.func(args)
    data = json.loads(output.read_text())
    points = grid(512)
    assert len(data["measured_steps"]) == 3 * len(points)
    # P=2's stages timed computing at once: one slowdown per grid point and repeat, at most
    # (only where the stage that finished first had company throughout, which a tiny
    # model's millisecond steps may never show).
    assert len(data["fit"]["slowdowns"]["2"]) <= len(points)
    assert data["concurrent_slowdown"][0] == 1.0 and data["concurrent_slowdown"][1] > 0
