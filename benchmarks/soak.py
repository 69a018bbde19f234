"""Soak: `pipellm serve -pp 2` under a long mixed load, then checks that it is whole again.

NUM requests (default 1000) at CONCURRENCY (default 64) from a closed-loop client: completions
and chats, streamed or not, random prompt and output lengths, and DISCONNECT (default 10%) of
the clients closing their stream after a few chunks. Then it checks:
  - 0 failures among the requests that were not dropped on purpose;
  - the engine back to idle: no request running or waiting, the KV cache as empty as before;
  - the server's memory (API process + engine core + stages, RSS) flat between the two halves:
    measured after the first half and at the end, growth under --max-growth-mb.
Exits 1 if a check fails. Run it alone on the machine (figures in docs/reliability.md):

  .venv/bin/python benchmarks/soak.py [--model M] [--num-requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from pipellm.testing.server_process import ServerProcess

WORDS = "pipeline stage token cache batch prompt request stream model layer".split()


@dataclass
class Tally:
    ok: int = 0
    dropped: int = 0  # disconnected on purpose
    failures: list[str] = field(default_factory=list)
    tokens: int = 0


def server_rss_mb(server: ServerProcess) -> float:
    root = psutil.Process(server.process.pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def scrape(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    values: dict[str, float] = {}
    for line in lines:
        if line.startswith("pipellm:") and "stage=" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def payload(rng: random.Random, stream: bool, max_prompt_words: int, max_tokens: int) -> tuple:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, max_prompt_words)))
    body: dict = {"max_tokens": rng.randint(1, max_tokens), "stream": stream, "ignore_eos": True}
    body["temperature"] = rng.choice([0.0, 0.8])
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def one(
    session: aiohttp.ClientSession,
    base_url: str,
    rng: random.Random,
    args: argparse.Namespace,
    tally: Tally,
) -> None:
    drop = rng.random() < args.disconnect
    stream = drop or rng.random() < 0.5
    path, body = payload(rng, stream, args.max_prompt_words, args.max_tokens)
    if drop:
        body["max_tokens"] = args.max_tokens  # long enough to still be running when dropped
    try:
        async with session.post(base_url + path, json=body) as response:
            if response.status != 200:
                tally.failures.append(f"HTTP {response.status}: {(await response.text())[:200]}")
                return
            if not stream:
                tally.tokens += (await response.json())["usage"]["completion_tokens"]
                tally.ok += 1
                return
            chunks, done = 0, False
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                if b'"error"' in data and "error" in json.loads(data):
                    tally.failures.append(f"error event: {data[:200]!r}")
                    return
                chunks += 1
                if drop and chunks >= 3:
                    tally.dropped += 1
                    return  # leaving the block closes the connection mid-stream
            if done:
                tally.ok += 1
                tally.tokens += chunks
            else:
                tally.failures.append("stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError) as error:
        tally.failures.append(f"{type(error).__name__}: {error}")


async def run_half(
    base_url: str, count: int, args: argparse.Namespace, rng: random.Random, tally: Tally
) -> None:
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        todo = iter(range(count))

        async def client() -> None:
            for _ in todo:
                await one(session, base_url, rng, args, tally)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))


def wait_idle(base_url: str, kv_before: float, timeout_s: float) -> tuple[bool, dict, float]:
    started = time.monotonic()
    while True:
        metrics = scrape(base_url)
        idle = (
            metrics["pipellm:num_requests_running"] == 0
            and metrics["pipellm:num_requests_waiting"] == 0
            and metrics["pipellm:kv_cache_usage_perc"] <= kv_before
        )
        if idle or time.monotonic() - started > timeout_s:
            return idle, metrics, time.monotonic() - started
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model to serve (default: the built-in SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--disconnect", type=float, default=0.1, help="fraction dropped mid-stream")
    parser.add_argument("--max-prompt-words", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-growth-mb", type=float, default=64.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-flag", action="append", default=[], help="extra serve flag")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    log = Path(tempfile.mkdtemp(prefix="pipellm-soak-")) / "server.log"
    flags = ([args.model] if args.model else []) + ["-pp", "2", *args.server_flag]
    server = ServerProcess(flags, log)
    server.start()
    try:
        base_url = server.base_url
        kv_before = scrape(base_url)["pipellm:kv_cache_usage_perc"]
        rss_start = server_rss_mb(server)
        halves = [args.num_requests // 2, args.num_requests - args.num_requests // 2]
        tally, rss, elapsed = Tally(), [], []
        for count in halves:
            started = time.perf_counter()
            asyncio.run(run_half(base_url, count, args, rng, tally))
            elapsed.append(time.perf_counter() - started)
            idle, metrics, idle_s = wait_idle(base_url, kv_before, 30.0)
            rss.append(server_rss_mb(server))
            print(
                f"half {len(rss)}: {count} requests in {elapsed[-1]:.1f} s; idle {idle} after "
                f"{idle_s:.2f} s (running {metrics['pipellm:num_requests_running']:.0f}, "
                f"waiting {metrics['pipellm:num_requests_waiting']:.0f}, KV "
                f"{metrics['pipellm:kv_cache_usage_perc']:.3f}); server RSS {rss[-1]:.0f} MB"
            )
        growth = rss[1] - rss[0]
        print(
            f"requests {args.num_requests} at concurrency {args.concurrency}: ok {tally.ok}, "
            f"dropped on purpose {tally.dropped}, failed {len(tally.failures)}; "
            f"{tally.tokens} tokens in {sum(elapsed):.1f} s"
        )
        print(
            f"server RSS: start {rss_start:.0f} MB, after half 1 {rss[0]:.0f} MB, after half 2 "
            f"{rss[1]:.0f} MB (growth {growth:+.0f} MB, limit {args.max_growth_mb:.0f})"
        )
        for failure in tally.failures[:10]:
            print("  failure:", failure)
        checks = {
            "0 failures": not tally.failures,
            "all accounted for": tally.ok + tally.dropped + len(tally.failures)
            == args.num_requests,
            "idle at the end": idle,
            "memory flat": growth < args.max_growth_mb,
        }
        print(
            "checks:",
            ", ".join(f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in checks.items()),
        )
        return 0 if all(checks.values()) else 1
    finally:
        survivors = server.stop()
        print(
            f"server exit code {server.process.returncode}, survivors {len(survivors)}; log {log}"
        )


if __name__ == "__main__":
    sys.exit(main())
