"""Renders a pipeline trace (Chrome/Perfetto JSON from --trace-file) as a PNG timeline.

One lane per stage, one bar per micro-batch; the gaps between bars are the bubbles.
Usage: pipellm trace timeline TRACE.json OUT.png [--title T] [--seconds S]
"""

from __future__ import annotations

import json
from pathlib import Path


def load_slices(trace_path: str | Path) -> dict[int, list[tuple[float, float, str]]]:
    """Per stage lane: (start_s, duration_s, name) of every micro-batch slice."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    lanes: dict[int, list[tuple[float, float, str]]] = {}
    for event in events:
        if event.get("ph") == "X":
            lanes.setdefault(event["tid"], []).append(
                (event["ts"] / 1e6, event["dur"] / 1e6, event["name"])
            )
    return lanes


def render_timeline(
    trace_path: str | Path, png_path: str | Path, title: str = "", seconds: float | None = None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = load_slices(trace_path)
    stages = sorted(lanes)
    start = min(s for lane in lanes.values() for s, _, _ in lane)
    end = max(s + d for lane in lanes.values() for s, d, _ in lane)
    if seconds is not None:
        end = min(end, start + seconds)
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(stages)))
    for row, stage in enumerate(stages):
        bars = [(s - start, d) for s, d, _ in lanes[stage] if s < end]
        names = [n for s, _, n in lanes[stage] if s < end]
        ax.broken_barh(
            bars,
            (row - 0.4, 0.8),
            facecolors=[colors[int(n.split()[-1]) % len(colors)] for n in names],
            edgecolor="black",
            linewidth=0.3,
        )
        busy = sum(min(d, (end - start) - s) for s, d in bars)
        ax.text(end - start, row, f" busy {busy / (end - start):.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.set_ylim(len(stages) - 0.5, -0.5)
    ax.set_xlim(0, (end - start) * 1.08)
    ax.set_xlabel("seconds (bar colour = micro-batch; white gaps = idle stage)")
    ax.set_title(title or Path(trace_path).name)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
