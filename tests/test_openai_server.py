"""`pipellm serve` end to end: a real server process on a tiny checkpoint, driven by the
official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
import transformers

from pipellm import LLM, SamplingParams
from pipellm.loader.source import resolve_model
from pipellm.testing.server_process import ServerProcess
from pipellm.text.tokenizer import load_tokenizer
from tests.checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512  # the tiny checkpoint's context
SMALL_KV_CACHE = ["--kv-cache-memory", str(16 * 2**20)]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    # A small token budget splits longer prompts into chunks over several engine steps.
    flags = ["--api-key", API_KEY, "--max-num-batched-tokens", "64", *SMALL_KV_CACHE]
    process = ServerProcess([str(checkpoint), *flags], log)
    with process:
        yield process
        survivors = process.stop(timeout_s=30)
        assert process.process.returncode == 0, process.log[-3000:]
        assert survivors == [], f"processes outlived the server: {survivors}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(checkpoint):
    return str(checkpoint)  # the served model name: the MODEL argument


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(resolve_model(str(checkpoint)))


@pytest.fixture(scope="module")
def offline_greedy(checkpoint, tokenizer):
    """pipellm's offline greedy text for PROMPT: what the server must answer."""
    with LLM(str(checkpoint), kv_cache_memory=16 * 2**20) as llm:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def http(
    server: ServerProcess,
    path: str,
    body: bytes | dict | None = None,
    method: str | None = None,
    api_key: str | None = API_KEY,
) -> tuple[int, bytes]:
    """A raw request; returns (status, body) for errors too."""
    data = json.dumps(body).encode() if isinstance(body, dict | list) else body
    request = urllib.request.Request(f"{server.base_url}{path}", data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def scrape(server: ServerProcess) -> dict[str, float]:
    """/metrics as {name{labels}: value}, for the pipellm: series."""
    status, body = http(server, "/metrics")
    assert status == 200
    values = {}
    for line in body.decode().splitlines():
        if line.startswith("pipellm:"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r"\{.*\}", "", name) if "stage=" not in name else name] = float(value)
    return values


# ---- the happy paths ----------------------------------------------------------------------------


def test_models_version_health(server, client, checkpoint):
    models = client.models.list().data
    assert [m.id for m in models] == [str(checkpoint)]
    assert http(server, "/health", api_key=None)[0] == 200
    status, body = http(server, "/version", api_key=None)
    assert status == 200 and json.loads(body)["version"]


def test_completion_matches_offline_engine(client, tokenizer, offline_greedy, model):
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == offline_greedy
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_completion_token_id_prompts(client, tokenizer, offline_greedy):
    ids = tokenizer.encode(PROMPT)
    for prompt in (ids, [ids]):
        out = client.completions.create(
            model=None,  # the server's one model
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == offline_greedy


def test_streamed_completion_counts_tokens(client, tokenizer, offline_greedy, model):
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 24  # one chunk per token
    assert "".join(c.choices[0].text for c in token_chunks) == offline_greedy
    assert token_chunks[-1].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(tokenizer.encode(PROMPT)), 24)


def test_chat_whole_and_streamed_agree(client, tokenizer, model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    template = tokenizer.apply_chat_template(messages)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(template, add_special_tokens=False))
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_text_parts_and_default_max_tokens(client, tokenizer, model):
    content = "Hello, world! " * 36  # leaves a few tokens of the context for the answer
    template = tokenizer.apply_chat_template([{"role": "user", "content": content}])
    num_prompt = len(tokenizer.encode(template, add_special_tokens=False))
    assert MAX_MODEL_LEN - 40 < num_prompt < MAX_MODEL_LEN
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": content}]}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    # No max_tokens: the rest of the context.
    assert out.usage.prompt_tokens == num_prompt
    assert out.usage.completion_tokens == MAX_MODEL_LEN - num_prompt
    assert out.choices[0].finish_reason == "length"


def test_logprobs(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    # Keyed by token text, so tokens that decode alike (partial UTF-8) share an entry.
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    for logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob == pytest.approx(max(top.values()))
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_stop_string_and_seed(client, offline_greedy, model):
    stop = offline_greedy[6:9]
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == offline_greedy[: offline_greedy.index(stop)]
    seeded = [
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_penalties_and_logit_bias(client, tokenizer, model):
    """vLLM's sampling fields reach the engine: a +100 bias forces its token, penalties
    stop greedy repeats."""
    token = tokenizer.encode(" fox", add_special_tokens=False)[0]
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert out.choices[0].text == tokenizer.decode([token] * 4)

    def chat(**extra) -> str:
        messages = [{"role": "user", "content": "Hi"}]
        out = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, **extra
        )
        assert out.usage.completion_tokens == 16
        return out.choices[0].message.content

    plain = chat(extra_body={"min_tokens": 16})
    penalised = chat(presence_penalty=2.0, extra_body={"repetition_penalty": 2.0, "min_tokens": 16})
    assert penalised != plain


def test_echo_gives_the_prompts_logprobs(client, checkpoint, tokenizer, model):
    """lm-eval's multiple-choice scoring: echo + logprobs + max_tokens 0 returns the prompt's
    tokens and logprobs (the first null), nothing generated; they equal transformers'."""
    ids = tokenizer.encode(PROMPT)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = [float(expected[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    # Echo with generation: the prompt, then the generated tokens, in one logprobs list.
    out = client.completions.create(
        model=model, prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    assert len(out.choices[0].logprobs.tokens) == len(ids) + 3
    assert out.choices[0].text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
    # vLLM's prompt_logprobs field, keyed by token id.
    extra = {"prompt_logprobs": 1}
    out = client.completions.create(model=model, prompt=ids, max_tokens=1, extra_body=extra)
    prompt_logprobs = out.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    pairs = zip(ids[1:], prompt_logprobs[1:], strict=True)
    got = [entry[str(token)]["logprob"] for token, entry in pairs]
    assert got == pytest.approx(want, abs=1e-4)


def test_n_parallel_samples(client, model):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=11, n=3)
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 15 and len({c.text for c in out.choices}) > 1
    assert [c.text for c in client.completions.create(**kwargs).choices] == [
        c.text for c in out.choices
    ]
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        n=2,
        stream=True,
    )
    finished = sorted(c.choices[0].index for c in stream if c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_metrics_exposition(server, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=3)
    values = scrape(server)
    for name in (
        "pipellm:num_requests_running",
        "pipellm:num_requests_waiting",
        "pipellm:kv_cache_usage_perc",
        "pipellm:num_micro_batches_in_flight",
        "pipellm:prompt_tokens_total",
        "pipellm:generation_tokens_total",
        "pipellm:time_to_first_token_seconds_count",
        "pipellm:inter_token_latency_seconds_count",
        "pipellm:e2e_request_latency_seconds_count",
    ):
        assert name in values, name
    for prefix in (
        "pipellm:stage_busy_fraction",
        "pipellm:stage_busy_seconds_total",
        "pipellm:pipeline_active_seconds_total",
    ):
        assert any(name.startswith(prefix) for name in values), prefix
    assert values["pipellm:generation_tokens_total"] >= 3


def wait_until_aborted(server: ServerProcess, idle_usage: float) -> dict[str, float]:
    """Polls /metrics until no request runs and the KV cache is back to idle_usage."""
    deadline = time.monotonic() + 10
    while True:
        values = scrape(server)
        idle = values["pipellm:num_requests_running"] == 0
        if idle and values["pipellm:kv_cache_usage_perc"] == idle_usage:
            assert values["pipellm:num_requests_waiting"] == 0
            return values
        assert time.monotonic() < deadline, f"the request was not aborted: {values}"
        time.sleep(0.1)


def test_dropped_stream_is_aborted(server, client, model):
    before = scrape(server)
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=480, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert scrape(server)["pipellm:num_requests_running"] == 1
    stream.close()
    after = wait_until_aborted(server, before["pipellm:kv_cache_usage_perc"])
    generated = after["pipellm:generation_tokens_total"] - before["pipellm:generation_tokens_total"]
    assert generated < 480


def test_dropped_whole_request_is_aborted(server):
    before = scrape(server)
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": False}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while scrape(server)["pipellm:num_requests_running"] != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    after = wait_until_aborted(server, before["pipellm:kv_cache_usage_perc"])
    generated = after["pipellm:generation_tokens_total"] - before["pipellm:generation_tokens_total"]
    assert generated < 480


def test_concurrent_requests_each_get_their_own_tokens(server, model):
    async def run_all() -> list[int]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        )

        async def one(i: int) -> int:
            kwargs = {"model": model, "max_tokens": 5 + i, "extra_body": {"ignore_eos": True}}
            if i % 2:
                out = await client.completions.create(prompt=f"{PROMPT} {i}", **kwargs)
                return out.usage.completion_tokens
            stream = await client.completions.create(prompt=f"{PROMPT} {i}", stream=True, **kwargs)
            return len([chunk async for chunk in stream])

        try:
            return await asyncio.gather(*(one(i) for i in range(12)))
        finally:
            await client.close()

    assert asyncio.run(run_all()) == [5 + i for i in range(12)]


def test_api_key(server, model):
    assert http(server, "/v1/models", api_key=None)[0] == 401
    status, body = http(server, "/v1/models", api_key="wrong")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert http(server, "/v1/models")[0] == 200
    no_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    # Only /v1/* needs the key.
    assert http(server, "/health", api_key=None)[0] == 200
    assert http(server, "/metrics", api_key=None)[0] == 200


TOO_LONG = [5] * MAX_MODEL_LEN
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_REQUESTS = [
    # (path, body, status, words the message must contain)
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens":', 400, "not valid JSON"),
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, 400, "stop: give a string"),
    (COMPLETIONS, b"[1, 2]", 400, "invalid request"),
    (COMPLETIONS, b"", 400, "JSON"),
    (COMPLETIONS, {"max_tokens": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 1000}, 400, "maximum context length is 512"),
    (COMPLETIONS, {"prompt": TOO_LONG, "max_tokens": 1}, 400, "prompt has 512 tokens"),
    (COMPLETIONS, {"prompt": [5, 999999]}, 400, "999999"),
    (COMPLETIONS, {"prompt": [-1]}, 400, "out of range"),
    (COMPLETIONS, {"prompt": ""}, 400, "empty"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    (COMPLETIONS, {"prompt": {"text": "hi"}}, 400, "prompt: give text, a list of token ids"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n=0"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "echo": True, "stream": True}, 400, "echo"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens=0 needs echo"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 30}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "token id 99999"),
    (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream"),
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "logprobs"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**5},
        400,
        "maximum context length",
    ),
    ("/v1/nothing", {"prompt": "hi"}, 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD_REQUESTS)
def test_bad_request_gets_clear_error(server, path, body, status, words):
    got, raw = http(server, path, body)
    error = json.loads(raw)["error"]
    assert got == status, error
    assert words in error["message"], error["message"]
    assert error["type"] and "param" in error and "code" in error


def test_serves_after_bad_requests(server, client, model):
    assert len(BAD_REQUESTS) >= 15
    for path, body, _, _ in BAD_REQUESTS:
        http(server, path, body)
    assert http(server, COMPLETIONS, method="GET")[0] == 405
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 4
    assert http(server, "/health")[0] == 200
