"""Chat templates: where one comes from (the model, or --chat-template) and how it renders."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# How to give a model a template, named wherever a missing one is reported.
HOW_TO_GIVE_A_TEMPLATE = (
    "give one with --chat-template FILE (pipellm serve, pipellm generate --chat) or "
    "LLM.chat(..., chat_template=TEXT), or use the completions API with a plain prompt"
)
# A value of --chat-template that holds one of these is the template itself (vLLM's rule).
_TEMPLATE_CHARACTERS = "{}\n"


class NoChatTemplateError(ValueError):
    """The model has no chat template and none was given."""


def read_chat_template(value: str) -> str:
    """The template --chat-template names: a file's text, or `value` itself if it looks like a
    template rather than a path (as vLLM reads the flag). Raises ValueError naming the flag
    if the file cannot be read or the template does not compile."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            template = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--chat-template {value!r}: cannot read the file: {error}") from None
    elif any(character in value for character in _TEMPLATE_CHARACTERS):
        template = value
    else:
        raise ValueError(
            f"--chat-template {value!r}: no such file; give the path of a Jinja chat template "
            "file (or the template itself)"
        )
    try:
        compile_template(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(
            f"--chat-template {value!r}: not a valid Jinja template: {error} (line {error.lineno})"
        ) from None
    return template


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` (and the functions the model may call, `tools`, in OpenAI's format)
    with a Jinja chat template, as transformers does."""
    try:
        return compile_template(template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template rejected the messages: {error}") from error


@functools.cache
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers gives templates."""
    # Templates are data from the checkpoint: a sandbox keeps them from reaching Python.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3 templates
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None) -> str:
    # jinja2's own tojson escapes HTML characters; transformers' keeps text as written.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
