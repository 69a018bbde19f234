"""A discrete-event clock: time moves only when something waits for a later event."""

from __future__ import annotations


class VirtualClock:
    """Seconds since the start of a simulation; `time` stands in for `time.time`."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def advance_to(self, when: float) -> None:
        """Moves the clock forward to `when` (never backward: events may lie in the past)."""
        if when > self.now:
            self.now = when
