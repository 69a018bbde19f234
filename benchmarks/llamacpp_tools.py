"""llama.cpp's `ggml-rpc-server` and `llama-server`, built from the llama.cpp sources that the
pinned llama-cpp-python sdist vendors, with its RPC backend on (-DGGML_RPC=ON), so every
comparison runs the llama.cpp that pipellm's `bench` extra names.

    python benchmarks/llamacpp_tools.py                  # build once into a cache, print paths
    python benchmarks/llamacpp_tools.py --build-dir DIR  # use an existing build (DIR/bin)

The sdist comes through pip (`pip download --no-binary :all:`), so a local index or mirror
works as for any package; the build needs cmake and a C++17 compiler (a few minutes on 2
cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pipellm-llamacpp"
# The RPC server's executable is ggml-rpc-server in this llama.cpp (tools/rpc/CMakeLists.txt);
# older trees and some packagers call it rpc-server.
RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server")
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=ON",  # this CPU's instructions, as pipellm's kernels use them
    "-DLLAMA_CURL=OFF",  # nothing is downloaded: models are local files
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
]


@dataclass(frozen=True)
class LlamaCppTools:
    rpc_server: Path
    llama_server: Path

    @property
    def library_dir(self) -> Path:
        return self.llama_server.parent  # shared builds put libllama/libggml beside the tools

    def env(self) -> dict[str, str]:
        """The environment the tools run in (their shared libraries found)."""
        path = os.environ.get("LD_LIBRARY_PATH", "")
        return dict(os.environ, LD_LIBRARY_PATH=f"{self.library_dir}:{path}".rstrip(":"))


def find_tools(build_dir: Path) -> LlamaCppTools | None:
    """The tools of an existing build (in DIR/bin or DIR), or None if either is missing."""
    for folder in (build_dir / "bin", build_dir):
        server = folder / "llama-server"
        rpc = next((folder / n for n in RPC_SERVER_NAMES if (folder / n).is_file()), None)
        if server.is_file() and rpc is not None:
            return LlamaCppTools(rpc, server)
    return None


def build_tools(cache_dir: Path = DEFAULT_CACHE) -> LlamaCppTools:
    """Downloads the sdist with pip, builds the two tools into cache_dir/build (once)."""
    build_dir = cache_dir / "build"
    found = find_tools(build_dir)
    if found is not None:
        return found
    for tool in ("cmake",):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs `{tool}` on PATH")
    source = _unpacked_sdist(cache_dir)
    _run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS])
    jobs = str(len(os.sched_getaffinity(0)))
    targets = ["llama-server", RPC_SERVER_NAMES[0]]
    _run(["cmake", "--build", str(build_dir), "--target", *targets, "-j", jobs])
    found = find_tools(build_dir)
    if found is None:
        raise RuntimeError(f"the build in {build_dir} made no llama-server and rpc server")
    return found


def _unpacked_sdist(cache_dir: Path) -> Path:
    """llama.cpp's source tree from the sdist (vendor/llama.cpp)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    archives = sorted(cache_dir.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        _run([*pip, "-d", str(cache_dir), SDIST])
        archives = sorted(cache_dir.glob("llama_cpp_python-*.tar.gz"))
    root = cache_dir / archives[-1].name.removesuffix(".tar.gz")
    if not root.is_dir():
        with tarfile.open(archives[-1]) as archive:
            archive.extractall(cache_dir, filter="data")
    source = root / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{archives[-1]} vendors no llama.cpp source tree")
    return source


def tools(build_dir: Path | None, cache_dir: Path = DEFAULT_CACHE) -> LlamaCppTools:
    """An existing build's tools where `build_dir` is given, else the cached build."""
    if build_dir is None:
        return build_tools(cache_dir)
    found = find_tools(build_dir)
    if found is None:
        raise RuntimeError(
            f"{build_dir} holds no llama-server and {' or '.join(RPC_SERVER_NAMES)} (in bin/ or "
            "itself); build llama.cpp with -DGGML_RPC=ON there, or leave --llamacpp-build out"
        )
    return found


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", type=Path, help="an existing llama.cpp build to use")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where to build")
    args = parser.parse_args()
    found = tools(args.build_dir, args.cache_dir)
    print(f"rpc server: {found.rpc_server}\nllama-server: {found.llama_server}")


if __name__ == "__main__":
    main()
