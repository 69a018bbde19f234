"""The built wheel ships the engine: the simulator's profiles are in it, the benchmarks not."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pipellm

REPO = Path(pipellm.__file__).parent.parent
# `pipellm bench serve`'s own modules: the only ones pipellm/bench/ may hold.
BENCH_SERVE = {"__init__", "serve", "client", "datasets", "metrics", "report", "plot"}


def test_wheel_holds_the_profiles_and_no_benchmark_script(tmp_path: Path) -> None:
    # No build isolation: the venv's setuptools builds it, with nothing fetched.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation"]
        + ["--quiet", "--wheel-dir", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("pipellm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(REPO).as_posix() for p in (REPO / "pipellm/sim/profiles").iterdir()}
    assert shipped and shipped <= names
    assert not [n for n in names if n.startswith("benchmarks/")]
    bench = {Path(n).stem for n in names if n.startswith("pipellm/bench/") and n.endswith(".py")}
    assert bench == BENCH_SERVE
    assert {n.split("/")[0] for n in names if n.endswith(".py")} == {"pipellm"}
