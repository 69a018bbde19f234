"""pipellm's packages form layers: each imports only the ones beneath it, so contracts sit below
their users and no two packages import each other. Every import counts, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pipellm

ROOT = Path(pipellm.__file__).parent
BENCHMARKS = ROOT.parent / "benchmarks"  # outside the package; absent from an installed wheel

# Bottom first. A unit is a subpackage of pipellm, a top-level module, pipellm's __init__, or a
# module or subpackage named here on its own ("sim.profiler" and "sim.simulate": they drive real
# stages or the engine loop, while the rest of sim/ sits beneath config so config can check a
# profile).
LAYERS = [
    "structured_outputs",  # a structured-output constraint, as a user states it
    "sampling_params",  # what a user asks for
    "protocol",  # the messages between engine, executors and stages
    "kernels",  # C++ CPU kernels
    "parallel",  # tensor-parallel collectives: shared memory on one host, gloo across
    "model",  # nn modules
    "loader",  # where a model and its weights come from
    "text",  # tokenizer, detokenizer
    "sim",  # modelled stage times: profiles, cost models, the virtual clock
    "config",  # every engine setting, checked against the model
    "worker",  # one pipeline stage
    "executor",  # how the stages run
    "engine",  # scheduler, KV blocks, the engine loop, its pipeline trace and the trace tools
    "sim.profiler",  # `pipellm profile`: times real stage steps and fits the cost model
    "llm",  # the offline API
    "pipellm",  # the package's public names
    "bench",  # `pipellm bench serve`: the HTTP load generator and its report
    "sim.simulate",  # `pipellm simulate`: bench serve's workload through the engine loop, modelled
    "testing",  # harnesses that start a real server (tests, the demo)
    "entrypoints",  # CLI and servers
    "benchmarks",  # top-level benchmarks/ (python benchmarks/NAME.py): leaves, they drive all
]


def unit_of(module: str) -> str | None:
    """The unit a dotted module name belongs to; None outside pipellm and benchmarks/."""
    parts = module.split(".")
    if parts[0] == "benchmarks":
        return "benchmarks"
    if parts[0] != "pipellm":
        return None
    if ".".join(parts[1:3]) in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "pipellm"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module an import statement in the file names, resolved to absolute names."""
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base != "pipellm":
                names.add(base)
                continue
            # `from pipellm import llm` imports that unit; `import LLM` one from __init__.
            for alias in node.names:
                is_unit = (root / alias.name).is_dir() or (root / f"{alias.name}.py").exists()
                names.add(f"pipellm.{alias.name}" if is_unit else "pipellm")
    return names


def unit_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {imported unit: [modules of the importing unit that import it]}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in [*sorted(ROOT.rglob("*.py")), *sorted(BENCHMARKS.glob("*.py"))]:
        source = unit_of(module_name(path))
        for name in imported_modules(path):
            target = unit_of(name)
            if target is not None and target != source:
                graph.setdefault(source, {}).setdefault(target, []).append(module_name(path))
    return graph


def test_every_unit_has_a_layer() -> None:
    units = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    units |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"} | {"pipellm"}
    missing = units - set(LAYERS)
    assert not missing, f"place {sorted(missing)} in LAYERS (tests/test_layering.py)"


def test_packages_import_only_layers_beneath_them() -> None:
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    upward = [
        f"{importer} imports pipellm.{target} ({', '.join(sorted(set(modules)))})"
        for importer, targets in unit_graph().items()
        for target, modules in targets.items()
        if rank[target] > rank[importer]
    ]
    assert not upward, "imports above their layer:\n" + "\n".join(upward)


def test_no_cycles_between_packages() -> None:
    graph = {unit: set(targets) for unit, targets in unit_graph().items()}
    state: dict[str, str] = {}  # "open" while on the DFS stack, then "done"

    def visit(unit: str, path: list[str]) -> list[str] | None:
        state[unit] = "open"
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == "open":
                return [*path, unit, target]
            if target not in state and (cycle := visit(target, [*path, unit])):
                return cycle
        state[unit] = "done"
        return None

    for unit in sorted(graph):
        if unit not in state:
            cycle = visit(unit, [])
            assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_the_check_sees_upward_and_lazy_imports(tmp_path: Path) -> None:
    """The parser finds imports inside functions and resolves relative ones."""
    module = tmp_path / "pipellm" / "worker" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "def f():\n    from pipellm.engine import core\n    from ..executor import base\n"
    )
    found = imported_modules(module, tmp_path / "pipellm")
    assert {unit_of(name) for name in found} == {"engine", "executor"}


def test_benchmarks_sit_outside_the_package() -> None:
    """A benchmark is a script beside the package, never a module of it; each one's imports
    count in the graph above as the top layer."""
    assert not (ROOT / "benchmarks").exists()
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert scripts, f"no benchmark scripts in {BENCHMARKS}"
    assert all(unit_of(module_name(p)) == "benchmarks" for p in scripts)
