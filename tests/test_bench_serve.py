"""`pipellm bench serve` end to end against a fake OpenAI server with a scripted token schedule."""

import argparse
import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from test_bench_datasets import TinyTokenizer

from pipellm.bench import serve

FIRST_TOKEN_S = 0.100  # request received -> first token
TOKEN_GAP_S = 0.020  # between later tokens
# Real sleeps on a shared machine: the server never sends early, so lower bounds are firm, but a
# busy client may read a chunk late, which lengthens TTFT and E2EL and can shorten a mean gap.
LATE_S = 0.100
GAP_TOLERANCE_MS = 8.0
MODEL = "fake-model"


class FakeOpenAIServer:
    """Streams max_tokens one-token chunks: the first after FIRST_TOKEN_S, then every TOKEN_GAP_S.

    Like real servers it sends an empty role chunk first (chat), an empty finish chunk last and
    then a usage chunk; fail_every=k answers every k-th request with HTTP 500.
    """

    def __init__(self, fail_every: int = 0, send_usage: bool = True) -> None:
        self.fail_every = fail_every
        self.send_usage = send_usage
        self.payloads: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        if self.fail_every and len(self.payloads) % self.fail_every == 0:
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        chat = "messages" in payload
        num_tokens = payload["max_completion_tokens" if chat else "max_tokens"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(text: str, finish_reason: str | None = None) -> None:
            choice = {"index": 0, "finish_reason": finish_reason}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())

        loop = asyncio.get_running_loop()
        received = loop.time()
        if chat:
            await send("")
        for k in range(num_tokens):
            # Absolute deadlines, so scheduling jitter does not pile up over a request.
            await asyncio.sleep(received + FIRST_TOKEN_S + k * TOKEN_GAP_S - loop.time())
            await send(f" tok{k}")
        await send("", finish_reason="length")
        if self.send_usage:
            usage = {"prompt_tokens": 1, "completion_tokens": num_tokens}
            await response.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def bench_args(server: FakeOpenAIServer, result_dir: Path, *flags: str) -> argparse.Namespace:
    """Flags for a run against server that writes any result file into result_dir."""
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    common = ["--port", str(server.port), "--disable-tqdm", "--result-dir", str(result_dir)]
    return parser.parse_args(common + list(flags))


def ms(seconds: float) -> float:
    return seconds * 1000


def assert_throughputs_follow(result: dict[str, Any]) -> None:
    duration = result["duration"]
    assert result["request_throughput"] == result["completed"] / duration
    assert result["output_throughput"] == result["total_output_tokens"] / duration
    total_tokens = result["total_input_tokens"] + result["total_output_tokens"]
    assert result["total_token_throughput"] == total_tokens / duration


def test_figures_match_the_schedule(tmp_path, capsys, monkeypatch) -> None:
    # 6 timed requests of 16 prompt tokens and 5 output tokens, 2 at a time: three waves of
    # 100 + 4 * 20 = 180 ms each. The 4 warmups before them (two more waves) are not timed.
    wave_s = FIRST_TOKEN_S + 4 * TOKEN_GAP_S
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: TinyTokenizer())
    plot_path = tmp_path / "run.png"
    with FakeOpenAIServer() as server:
        flags = ["--num-prompts", "6", "--max-concurrency", "2", "--num-warmups", "4"]
        flags += ["--random-input-len", "16", "--random-output-len", "5"]
        flags += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
        flags += ["--save-detailed", "--plot", str(plot_path)]
        result = serve.main(bench_args(server, tmp_path, *flags))

    assert len(server.payloads) == 10
    assert server.payloads[-1] == {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "prompt": server.payloads[-1]["prompt"],
        "max_tokens": 5,
        "ignore_eos": True,
    }
    assert (result["model_id"], result["completed"], result["failed"]) == (MODEL, 6, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (6 * 16, 6 * 5)
    assert result["max_concurrent_requests"] == 2
    assert 3 * wave_s <= result["duration"] < 3 * wave_s + 0.3  # warmups would add 0.36
    assert_throughputs_follow(result)
    assert result["max_output_tokens_per_s"] == 30  # all 30 tokens land in the first second

    ttft_ms, e2el_ms = ms(FIRST_TOKEN_S), ms(wave_s)
    assert ttft_ms - 1 <= result["median_ttft_ms"] <= result["p99_ttft_ms"] < ttft_ms + ms(LATE_S)
    assert e2el_ms - 1 <= result["median_e2el_ms"] <= result["p99_e2el_ms"] < e2el_ms + ms(LATE_S)
    assert abs(result["mean_itl_ms"] - ms(TOKEN_GAP_S)) < GAP_TOLERANCE_MS
    assert abs(result["median_tpot_ms"] - ms(TOKEN_GAP_S)) < GAP_TOLERANCE_MS
    assert all(FIRST_TOKEN_S - 0.001 <= ttft < FIRST_TOKEN_S + LATE_S for ttft in result["ttfts"])
    assert [len(itl) for itl in result["itls"]] == [4] * 6
    assert result["output_lens"] == [5] * 6
    assert result["generated_texts"] == [" tok0 tok1 tok2 tok3 tok4"] * 6

    saved_files = list(tmp_path.glob("openai-infqps-concurrency2-fake-model-*.json"))
    assert len(saved_files) == 1
    assert json.loads(saved_files[0].read_text()) == result
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "Maximum request concurrency:             2         \n" in printed
    assert "----------------End-to-end Latency----------------" in printed


def test_failed_requests_are_counted_and_reported(tmp_path, capsys) -> None:
    with FakeOpenAIServer(fail_every=3) as server:
        flags = ["--num-prompts", "6", "--max-concurrency", "2", "--save-detailed"]
        flags += ["--random-input-len", "8", "--random-output-len", "3"]
        result = serve.run(bench_args(server, tmp_path, *flags), MODEL, TinyTokenizer())

    assert (result["completed"], result["failed"]) == (4, 2)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (4 * 8, 4 * 3)
    assert sum(error.startswith("HTTP 500: ") for error in result["errors"]) == 2
    assert result["max_concurrent_requests"] == 2
    assert_throughputs_follow(result)
    assert "2 requests failed; the first errors:" in capsys.readouterr().out


def test_chat_endpoint_without_usage_counts_chunks(tmp_path) -> None:
    with FakeOpenAIServer(send_usage=False) as server:
        flags = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
        flags += ["--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4"]
        result = serve.run(bench_args(server, tmp_path, *flags), MODEL, TinyTokenizer())

    payload = server.payloads[0]
    assert payload["messages"][0]["role"] == "user" and payload["max_completion_tokens"] == 4
    assert "prompt" not in payload and "max_tokens" not in payload
    assert (result["completed"], result["total_output_tokens"]) == (3, 12)
    # All three at once: the empty role chunk sent first must not count as the first token.
    assert result["max_concurrent_requests"] == 3
    assert result["mean_ttft_ms"] >= ms(FIRST_TOKEN_S) - 1
    assert abs(result["mean_tpot_ms"] - ms(TOKEN_GAP_S)) < GAP_TOLERANCE_MS


def test_request_rate_spaces_the_sends(tmp_path) -> None:
    offsets = serve.arrival_offsets(6, request_rate=25.0, burstiness=1.0, seed=4)
    with FakeOpenAIServer() as server:
        flags = ["--num-prompts", "6", "--request-rate", "25", "--seed", "4", "--save-detailed"]
        flags += ["--random-input-len", "8", "--random-output-len", "1"]
        result = serve.run(bench_args(server, tmp_path, *flags), MODEL, TinyTokenizer())

    assert result["request_rate"] == 25.0
    assert result["start_times"] == pytest.approx(offsets, abs=LATE_S / 2)
    assert result["mean_tpot_ms"] == 0.0  # one token each: no TPOT


def test_sharegpt_dataset_sends_no_ignore_eos(tmp_path) -> None:
    path = tmp_path / "sharegpt.json"
    turns = [{"from": "human", "value": "Tell me about the quick brown fox."}]
    turns.append({"from": "gpt", "value": "It jumps over the lazy dog."})
    path.write_text(json.dumps([{"conversations": turns}]))
    with FakeOpenAIServer() as server:
        flags = ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "2"]
        flags += ["--sharegpt-output-len", "3"]
        result = serve.run(bench_args(server, tmp_path, *flags), MODEL, TinyTokenizer())

    assert result["completed"] == 2 and result["total_output_tokens"] == 6
    assert "ignore_eos" not in server.payloads[0]


def test_arrival_offsets() -> None:
    assert serve.arrival_offsets(4, float("inf"), 1.0, seed=0) == [0.0] * 4
    poisson = serve.arrival_offsets(20000, 10.0, 1.0, seed=0)
    assert poisson == serve.arrival_offsets(20000, 10.0, 1.0, seed=0)
    assert poisson[0] == 0.0
    for burstiness in [1.0, 4.0]:
        gaps = np.diff(serve.arrival_offsets(20000, 10.0, burstiness, seed=0))
        # Gamma gaps: mean 1 / rate, squared coefficient of variation 1 / burstiness.
        assert gaps.mean() == pytest.approx(0.1, rel=0.03)
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.05)


def test_seed_command_line_parses_with_familiar_defaults() -> None:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    seed_line = "--model nvidia/DeepSeek-R1-0528-FP4-v2 --host 127.0.0.1 --port 8000 "
    seed_line += "--dataset-name random --max-concurrency 8 --num-prompts 256 "
    seed_line += "--random-input-len 4000 --random-output-len 32 --random-range-ratio 0 "
    seed_line += "--num-warmups 20"
    args = parser.parse_args(seed_line.split())
    assert (args.max_concurrency, args.num_prompts, args.num_warmups) == (8, 256, 20)
    expected = {
        "endpoint": "/v1/completions",
        "request_rate": float("inf"),
        "burstiness": 1.0,
        "num_prompts": 1000,
        "random_input_len": 1024,
        "random_output_len": 128,
        "random_range_ratio": 0.0,
        "random_prefix_len": 0,
        "percentile_metrics": "ttft,tpot,itl",
        "metric_percentiles": "99",
        "seed": 0,
        "num_warmups": 0,
        "model": None,
        "tokenizer": None,
        "max_concurrency": None,
    }
    defaults = vars(parser.parse_args([]))
    assert {name: defaults[name] for name in expected} == expected


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--burstiness", "-1"], "--burstiness must be > 0"),
        (["--backend", "openai-chat"], "add --endpoint /v1/chat/completions"),
        (["--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["--percentile-metrics", "ttft,foo"], "unknown \\['foo'\\]"),
        (["--metric-percentiles", "101"], "must lie in \\[0, 100\\]"),
    ],
)
def test_bad_settings_fail_with_the_flag_named(flags: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    with pytest.raises(SystemExit, match=message):
        serve.run(parser.parse_args(flags), MODEL, TinyTokenizer())
