"""One streamed request to an OpenAI-compatible server, timed chunk by chunk."""

import json
import time
from typing import Any

import aiohttp

from pipellm.bench.datasets import SampleRequest
from pipellm.bench.metrics import RequestTiming

# How much of an error response body to keep in the error message.
ERROR_BODY_CHARS = 300


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(
    request: SampleRequest, model: str, chat: bool, ignore_eos: bool
) -> dict[str, Any]:
    """The JSON body: greedy, streamed, with usage numbers in the last chunk."""
    payload: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(chunk: dict[str, Any]) -> str:
    """Output text of one stream chunk (completions or chat delta); "" for usage-only chunks."""
    choices = chunk.get("choices") or [{}]
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"]
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def send_request(
    http: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    prompt_len: int,
    headers: dict[str, str],
) -> RequestTiming:
    """Send one streaming request; failures are reported in the output, never raised."""
    out = RequestTiming(prompt_len=prompt_len)
    text_parts: list[str] = []
    usage_tokens: int | None = None
    finished = False
    out.start_time = time.perf_counter()
    try:
        async with http.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:ERROR_BODY_CHARS]
                out.error = f"HTTP {response.status}: {body}"
            else:
                async for raw_line in response.content:
                    arrival = time.perf_counter()
                    line = raw_line.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error = f"error in stream: {chunk['error']}"
                        break
                    if text := _chunk_text(chunk):
                        out.chunk_times.append(arrival)
                        text_parts.append(text)
                    if usage := chunk.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
                if not finished and not out.error:
                    out.error = "stream ended without data: [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end_time = time.perf_counter()
    out.success = finished
    out.generated_text = "".join(text_parts)
    out.output_tokens = usage_tokens if usage_tokens is not None else len(out.chunk_times)
    return out
