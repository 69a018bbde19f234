"""Chat templates: the model's own, --chat-template (serve, generate) and LLM.chat's
chat_template replacing or supplying one, and a clear refusal when a model has none."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from pipellm import LLM, SamplingParams
from pipellm.entrypoints.cli import main
from pipellm.loader.source import resolve_model
from pipellm.testing.server_process import ServerProcess
from pipellm.text.chat_template import NoChatTemplateError, read_chat_template
from pipellm.text.tokenizer import Tokenizer, load_tokenizer
from tests.checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(180)

SMALL_KV_CACHE = 16 * 2**20
MESSAGES = [{"role": "user", "content": "Say hello"}]
# Gemma's turn format: what a user gives a base model's GGUF, which carries no template.
TURN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def without_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose tokenizer_config.json has no chat template."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("no-template"), num_layers=1)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "turns.jinja"
    path.write_text(TURN_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tokenizer(without_template: Path) -> Tokenizer:
    return load_tokenizer(resolve_model(str(without_template)))


def test_read_chat_template(template_file: Path, tmp_path: Path) -> None:
    assert read_chat_template(str(template_file)) == TURN_TEMPLATE
    # As vLLM reads the flag: a value that looks like a template is the template.
    assert read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match=r"--chat-template .*missing.jinja.*no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"--chat-template .*not a valid Jinja template"):
        read_chat_template(str(broken))


def test_no_template_names_the_fix_and_a_given_one_applies(tokenizer: Tokenizer) -> None:
    with pytest.raises(NoChatTemplateError, match="--chat-template FILE"):
        tokenizer.apply_chat_template(MESSAGES)
    assert tokenizer.apply_chat_template(MESSAGES, chat_template=TURN_TEMPLATE) == (
        "<|im_start|><start_of_turn>user\nSay hello<end_of_turn>\n<start_of_turn>model\n"
    )


def test_offline_chat(without_template: Path, tokenizer: Tokenizer) -> None:
    """LLM.chat takes the template's text, as vLLM's does; without one it refuses."""
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(str(without_template), kv_cache_memory=SMALL_KV_CACHE) as llm:
        with pytest.raises(NoChatTemplateError, match="chat_template"):
            llm.chat(MESSAGES, params, use_tqdm=False)
        out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=TURN_TEMPLATE)[0]
    rendered = tokenizer.apply_chat_template(MESSAGES, chat_template=TURN_TEMPLATE)
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_bad_flag_fails_before_any_process(
    without_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["serve"], ["generate", "--chat", "--prompt", "hi"]):
        with pytest.raises(SystemExit) as exit:
            main([*command, str(without_template), "--chat-template", str(tmp_path / "no.jinja")])
        assert exit.value.code == 2
        assert "--chat-template" in capsys.readouterr().err


def _serve(folder: Path, log: Path, *flags: str) -> ServerProcess:
    return ServerProcess([str(folder), "--kv-cache-memory", str(SMALL_KV_CACHE), *flags], log)


def test_served_chat_without_template_is_a_400_naming_the_flag(
    without_template: Path, tmp_path: Path
) -> None:
    with _serve(without_template, tmp_path / "log") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=str(without_template), messages=MESSAGES)
        body = error.value.body
        assert body["type"] == "invalid_request_error" and body["param"] == "messages"
        assert "--chat-template" in body["message"]
        completion = client.completions.create(
            model=str(without_template), prompt="Hello", max_tokens=2
        )
        assert completion.usage.completion_tokens == 2  # plain prompts still work
        assert server.stop(timeout_s=30) == []


def test_served_chat_template_flag_replaces_the_models(
    template_file: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """(The server sets the flag's template on its tokenizer; a model without one gets it the
    same way, as test_offline_chat shows for LLM.chat.)"""
    folder = make_tiny_checkpoint(tmp_path / "with-template", num_layers=1)
    with _serve(folder, tmp_path / "log", "--chat-template", str(template_file)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model=str(folder), messages=MESSAGES, max_tokens=2)
        assert server.stop(timeout_s=30) == []

    def num_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    expected = num_tokens(tokenizer.apply_chat_template(MESSAGES, chat_template=TURN_TEMPLATE))
    assert reply.usage.prompt_tokens == expected
    own = load_tokenizer(resolve_model(str(folder))).apply_chat_template(MESSAGES)
    assert num_tokens(own) != expected  # the model's own template gives another prompt
