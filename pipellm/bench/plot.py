"""One PNG of a serving run: TTFT and ITL distributions and output tokens/s over time."""

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from pipellm.bench.metrics import RequestTiming, output_tokens_per_second  # noqa: E402


def plot_run(outputs: list[RequestTiming], benchmark_start: float, path: str, title: str) -> None:
    """Draw the three panels of a run's successful requests into path."""
    done = [out for out in outputs if out.success]
    ttfts_ms = [out.ttft * 1000 for out in done]
    itls_ms = [gap * 1000 for out in done for gap in out.itl]
    per_second = output_tokens_per_second(outputs, benchmark_start)

    fig, (ax_ttft, ax_itl, ax_rate) = plt.subplots(1, 3, figsize=(15, 4.5))
    fig.suptitle(title)
    ax_ttft.hist(ttfts_ms, bins=50)
    ax_ttft.set(title="Time to first token", xlabel="ms", ylabel="requests")
    ax_itl.hist(itls_ms, bins=50)
    ax_itl.set(title="Inter-token latency", xlabel="ms", ylabel="gaps")
    ax_rate.bar(range(len(per_second)), per_second, width=1.0, align="edge")
    ax_rate.set(title="Output throughput", xlabel="seconds since start", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
