"""pipellm/bench/sim_steps.py: real micro-batches grouped by kind against a profile's times."""

import pytest

from pipellm.bench.sim_steps import Step, kind_of, summarize
from pipellm.sim.shapes import BatchShape


def test_micro_batch_kinds():
    assert kind_of([(512, 1), (300, 1)]) == "decode x2"
    assert kind_of([(0, 128)]) == "chunk"
    assert kind_of([(512, 1), (256, 127)]) == "chunk +dec"
    assert kind_of([(512, 1), (500, 12)]) == "tail +dec"
    assert kind_of([(0, 512)] * 4) == "prompts x4"
    assert kind_of([(510, 2), (0, 126)]) == "prompts x2"
    assert kind_of([(513, 1), (507, 5), (0, 122)]) == "prompts x2 +1 dec"


def test_summary_sums_and_ratios_per_kind_and_stage():
    shape = BatchShape(1, 1, 1, 1.0, 1)
    steps = [
        Step("decode x1", [(10, 1)], shape, [0.2, 0.3], [0.1, 0.3]),
        Step("decode x1", [(11, 1)], shape, [0.4, 0.3], [0.1, 0.3]),
        Step("chunk", [(0, 64)], shape, [1.0, 1.0], [2.0, 1.0]),
    ]
    rows = {(r["kind"], r["stage"]): r for r in summarize(steps)}
    # chunk: 2.0 of the 3.2 s measured in all; decodes: 1.2 s.
    chunk0, decode0, decode1 = rows["chunk", 0], rows["decode x1", 0], rows["decode x1", 1]
    assert chunk0["share"] == pytest.approx(2.0 / 3.2)
    assert chunk0["measured_s"] == 1.0 and chunk0["predicted_s"] == 2.0
    assert decode0["count"] == 2 and decode0["measured_s"] == pytest.approx(0.6)
    assert decode0["predicted_s"] == pytest.approx(0.2)
    assert decode0["median_ratio"] == pytest.approx(3.0)  # ratios 2 and 4
    assert decode1["median_ratio"] == pytest.approx(1.0)
    assert [r["kind"] for r in summarize(steps)][:2] == ["chunk", "chunk"]  # largest first
