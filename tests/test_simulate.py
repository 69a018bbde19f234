"""`pipellm simulate`: the real engine loop in virtual time, checked against figures computed
by hand and against the same workload served in real time."""

import itertools
import json

import pytest

from pipellm.bench.serve import arrival_offsets
from pipellm.entrypoints.cli import build_parser
from pipellm.testing.server_process import ServerProcess
from tests.sim_models import make_word_model, write_profile

STEP_S = 0.1  # every stage, every micro-batch


def simulate(tmp_path, *flags: str, slowdown: list[float] | None = None) -> dict:
    model = make_word_model(tmp_path / "model")
    const = {"cost_model": "linear", "linear": {"step_s": STEP_S}}
    if slowdown is not None:
        const["concurrent_slowdown"] = slowdown
    profile = write_profile(tmp_path / "const.json", const)
    argv = ["simulate", str(model), "--sim-profile", profile, "--random-input-len", "32"]
    argv += ["--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    args = build_parser().parse_args([*argv, *flags])
    args.func(args)
    return json.loads((tmp_path / "r.json").read_text())


def test_two_stages_two_requests_by_hand(tmp_path):
    """P=2, 2 requests at once, 4 tokens each, 0.1 s per stage step. Balanced, each micro-batch
    takes one request (max_num_seqs / P): prefill A [0, 0.2], prefill B [0.1, 0.3], then each
    request's decode follows its own previous micro-batch, so A's tokens land at 0.2, 0.4,
    0.6, 0.8 and B's at 0.3, 0.5, 0.7, 0.9."""
    flags = ["-pp", "2", "--max-num-seqs", "2", "--num-prompts", "2", "--max-concurrency", "2"]
    r = simulate(tmp_path, *flags, "--random-output-len", "4")
    assert r["completed"] == 2 and r["total_output_tokens"] == 8
    assert r["ttfts"] == pytest.approx([0.2, 0.3])
    assert r["e2els"] == pytest.approx([0.8, 0.9])
    assert [gap for gaps in r["itls"] for gap in gaps] == pytest.approx([0.2] * 6)
    assert r["duration"] == pytest.approx(0.9)
    assert r["mean_tpot_ms"] == pytest.approx(200.0)
    assert r["request_throughput"] == pytest.approx(2 / 0.9)


def test_stages_that_slow_each_other_down_by_hand(tmp_path):
    """The workload above on stages that share a machine: two stages computing at once each
    take twice as long (concurrent_slowdown [1, 2]). Prefill A alone on stage 0 [0, 0.1];
    then A on stage 1 and B on stage 0 together, both [0.1, 0.3]; B on stage 1 and A's first
    decode on stage 0 together [0.3, 0.5]; and so on, two steps at once every 0.2 s, so A's
    tokens land at 0.3, 0.7, 1.1, 1.5 and B's at 0.5, 0.9, 1.3; B's last decode then has
    stage 1 to itself, [1.5, 1.6]."""
    flags = ["-pp", "2", "--max-num-seqs", "2", "--num-prompts", "2", "--max-concurrency", "2"]
    r = simulate(tmp_path, *flags, "--random-output-len", "4", slowdown=[1.0, 2.0])
    assert r["ttfts"] == pytest.approx([0.3, 0.5])
    assert r["e2els"] == pytest.approx([1.5, 1.6])
    assert [gap for gaps in r["itls"] for gap in gaps] == pytest.approx([0.4] * 5 + [0.3])
    assert r["duration"] == pytest.approx(1.6)


def test_unbalanced_pipeline_by_hand(tmp_path):
    """--no-pp-balance (vLLM issue #27462's "before"): both prompts in one micro-batch, one
    micro-batch in flight at a time, so every token of both takes the whole pipe (0.2 s)."""
    flags = ["-pp", "2", "--max-num-seqs", "2", "--num-prompts", "2", "--max-concurrency", "2"]
    r = simulate(tmp_path, *flags, "--no-pp-balance", "--random-output-len", "4")
    assert r["ttfts"] == pytest.approx([0.2, 0.2])
    assert r["e2els"] == pytest.approx([0.8, 0.8])
    assert r["duration"] == pytest.approx(0.8)


def test_arrivals_wait_on_the_virtual_clock(tmp_path):
    """Requests far apart (rate 0.5/s, steady gaps) each meet an empty pipeline of 3 stages:
    TTFT 0.3 s, 3 tokens in 0.9 s; the run ends 0.9 s after the last arrival. (Each prompt
    in one micro-batch: the chunked pipeline would cut it over the stages, and under this
    profile's flat per-step time that costs steps without saving any.)"""
    flags = ["-pp", "3", "--num-prompts", "4", "--request-rate", "0.5", "--burstiness", "100"]
    flags.append("--no-enable-chunked-pipeline")
    r = simulate(tmp_path, *flags, "--random-output-len", "3")
    offsets = arrival_offsets(4, 0.5, 100.0, 0)
    assert min(b - a for a, b in itertools.pairwise(offsets)) > 1.0, "the requests never meet"
    assert r["start_times"] == pytest.approx(offsets)
    assert r["ttfts"] == pytest.approx([0.3] * 4)
    assert r["e2els"] == pytest.approx([0.9] * 4)
    assert r["duration"] == pytest.approx(offsets[-1] + 0.9)


def test_virtual_time_agrees_with_real_time(tmp_path, reaped):
    """One workload, served for real (`pipellm serve` over sleeping sim stages, loaded by
    `bench serve`) and simulated: duration and TPOT agree within 5%, mean TTFT and E2E latency
    within one stage step. The profile's serving delays are about what this machine's HTTP
    path and engine loop take (docs/simulation.md), but on a loaded machine a request of the
    first burst may miss the step it would join by a few ms and wait one step more, a
    quantum the virtual clock cannot reproduce, so latencies get one step of slack."""
    model = make_word_model(tmp_path / "model")
    profile = {
        "cost_model": "linear",
        "linear": {"step_s": 0.1},
        "link": {"dispatch_s": 0.003},
        "serving": {
            "request_latency_s": 0.003,
            "output_latency_s": 0.001,
            "send_interval_s": 0.003,
        },
    }
    engine = [str(model), "-pp", "2", "--max-num-seqs", "4"]
    engine += ["--sim-profile", write_profile(tmp_path / "p.json", profile)]
    workload = ["--dataset-name", "random", "--num-prompts", "12", "--max-concurrency", "4"]
    workload += ["--random-input-len", "48", "--random-output-len", "8", "--num-warmups", "4"]
    out = ["--save-result", "--result-dir", str(tmp_path)]
    serve = [*engine, "--distributed-executor-backend", "sim"]
    with ServerProcess(serve, tmp_path / "server.log") as server:
        bench = ["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(model)]
        args = build_parser().parse_args(
            [*bench, *workload, *out, "--result-filename", "real.json", "--disable-tqdm"]
        )
        args.func(args)
        server.stop()
    args = build_parser().parse_args(
        ["simulate", *engine, *workload, *out, "--result-filename", "virtual.json"]
    )
    args.func(args)
    real = json.loads((tmp_path / "real.json").read_text())
    virtual = json.loads((tmp_path / "virtual.json").read_text())
    assert real["completed"] == virtual["completed"] == 12
    for key in ("duration", "median_tpot_ms"):
        assert virtual[key] == pytest.approx(real[key], rel=0.05), key
    step_ms = profile["linear"]["step_s"] * 1000
    for key in ("mean_ttft_ms", "mean_e2el_ms"):
        assert virtual[key] == pytest.approx(real[key], abs=step_ms), key


def test_blocking_loop_makes_the_stages_take_turns(tmp_path):
    """--pp-blocking-loop (vLLM's loop before its PR #28768) in virtual time: one micro-batch
    in flight, so every micro-batch takes the whole pipe (0.2 s) and the run takes longer
    than the same balanced run with the loop that does not wait."""
    flags = ["-pp", "2", "--max-num-seqs", "2", "--num-prompts", "4", "--max-concurrency", "2"]
    flowing = simulate(tmp_path, *flags, "--random-output-len", "4")
    blocking = simulate(tmp_path, *flags, "--random-output-len", "4", "--pp-blocking-loop")
    assert blocking["completed"] == flowing["completed"] == 4
    # Every token waits for a whole micro-batch's passage: gaps are multiples of 0.2 s.
    gaps = [gap for gaps in blocking["itls"] for gap in gaps]
    assert all(round(gap / 0.2, 6) == round(gap / 0.2) and gap > 0 for gap in gaps)
    assert blocking["duration"] > flowing["duration"]
