"""The hand-over costs from hand-made micro-batch timestamps (pipellm/sim/hand_over.py)."""

import pytest

from pipellm.sim.hand_over import MicroBatchRecord, dispatch_gaps, hand_over, link_gaps

# Two stages, three micro-batches in submission order: (submitted, stage times, result).
RECORDS = [
    MicroBatchRecord(0.0, [(1.0, 2.0), (2.5, 3.5)], 3.7),
    # Stage 0 was busy with the first until 2.0 and stage 1 until 3.5: only the time after
    # those counts (raw gaps 1.6 and 0.6 would count the queueing the simulator adds itself).
    MicroBatchRecord(0.5, [(2.1, 3.0), (3.6, 4.0)], 4.1),
    MicroBatchRecord(3.2, [(3.4, 4.4), (4.7, 5.0)], 5.3),
]


def test_gaps_leave_out_the_wait_for_a_busy_stage():
    # link: 2.5 - 2.0; 3.6 - max(3.0, 3.5); 4.7 - max(4.4, 4.0)
    assert link_gaps(RECORDS) == pytest.approx([0.5, 0.1, 0.3])
    # dispatch: (1.0 - 0.0) + (3.7 - 3.5); (2.1 - max(0.5, 2.0)) + (4.1 - 4.0);
    # (3.4 - max(3.2, 3.0)) + (5.3 - 5.0)
    assert dispatch_gaps(RECORDS) == pytest.approx([1.2, 0.2, 0.5])


def test_hand_over_is_the_median_gap():
    measured = hand_over(RECORDS)
    assert measured.latency_s == pytest.approx(0.3)
    assert measured.dispatch_s == pytest.approx(0.5)


def test_one_stage_has_no_link_and_no_records_is_an_error():
    single = [MicroBatchRecord(0.0, [(0.25, 1.0)], 1.5), MicroBatchRecord(0.1, [(1.0, 2.0)], 2.25)]
    # (0.25 + 0.5) and (1.0 - max(0.1, 1.0) + 0.25)
    assert hand_over(single).latency_s == 0.0
    assert hand_over(single).dispatch_s == pytest.approx((0.75 + 0.25) / 2)
    with pytest.raises(ValueError, match="no micro-batch records"):
        hand_over([])
