"""The engine's channel to a stage: authenticated both ways, schedules run in order."""

import multiprocessing
import threading
from multiprocessing import AuthenticationError

import pytest

from pipellm.executor import stage_channel
from pipellm.protocol import ModelOutput, SchedulerOutput


def test_a_peer_without_the_key_is_refused_before_anything_is_unpickled():
    listener = stage_channel.listen("127.0.0.1", b"the stage's key")
    refused: list[BaseException] = []

    def accept() -> None:
        try:
            stage_channel.accept(listener)
        except AuthenticationError as error:
            refused.append(error)

    accepting = threading.Thread(target=accept)
    accepting.start()
    with pytest.raises(AuthenticationError):
        stage_channel.connect(listener.address, b"a guess")
    accepting.join(timeout=10)
    assert len(refused) == 1


class _RecordingStage:
    """Answers each schedule with its id as the sampled token; notes what came next."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None]] = []

    def step(self, scheduler_output: SchedulerOutput, following: SchedulerOutput | None):
        self.seen.append((scheduler_output.micro_batch_id, following and following.micro_batch_id))
        return ModelOutput(scheduler_output.micro_batch_id, [scheduler_output.micro_batch_id])


def test_schedules_run_in_order_and_none_ends_the_loop():
    key = b"k" * 32
    listener = stage_channel.listen("127.0.0.1", key)
    stage = _RecordingStage()
    served: list[BaseException | None] = []

    def serve() -> None:
        conn = stage_channel.accept(listener)
        try:
            stage_channel.serve_schedules(stage, conn)
            served.append(None)
        except BaseException as error:
            served.append(error)

    serving = threading.Thread(target=serve)
    serving.start()
    conn = stage_channel.connect(listener.address, key)
    for number in range(5):
        conn.send(SchedulerOutput(number, []))
    outputs = [conn.recv() for _ in range(5)]
    conn.send(None)
    serving.join(timeout=10)
    assert served == [None]
    assert [o.sampled_token_ids for o in outputs] == [[0], [1], [2], [3], [4]]
    assert [number for number, _ in stage.seen] == [0, 1, 2, 3, 4]
    # A stage is told the next schedule only when it is that one (to receive its inputs ahead).
    assert all(following in (None, number + 1) for number, following in stage.seen)
    conn.close()


def test_a_schedule_goes_to_every_stage_until_one_channel_is_closed():
    pairs = [multiprocessing.Pipe() for _ in range(3)]
    engine_ends = [engine_end for engine_end, _ in pairs]
    assert stage_channel.send_schedule(engine_ends, SchedulerOutput(7, [])) is None
    assert [stage_end.recv().micro_batch_id for _, stage_end in pairs] == [7, 7, 7]

    pairs[1][1].close()  # stage 1 is gone
    failed = stage_channel.send_schedule(engine_ends, SchedulerOutput(8, []))
    assert failed is not None and failed[0] == 1 and isinstance(failed[1], OSError)
    assert pairs[0][1].recv().micro_batch_id == 8
    assert not pairs[2][1].poll()  # nothing sent past the dead stage
