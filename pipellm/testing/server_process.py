"""`pipellm serve` as a child process, for the demo and the tests: started on a free port,
waited for until /health answers, stopped with a signal, and checked for leftover processes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

LISTENING = re.compile(r"listening on http://\S+?:(\d+)")
CORE_PID = re.compile(r"engine core ready \(pid (\d+)\)")
EXIT_GRACE_S = 5.0  # how long descendants may take to exit after the server did


class ServerProcess:
    """Runs `pipellm serve *args --port 0`; the log (stdout and stderr) goes to log_path."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "pipellm.entrypoints.cli", "serve", *args, "--port", "0"]
        self.log_path = Path(log_path)
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._descendants: dict[int, psutil.Process] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def core_pid(self) -> int:
        match = CORE_PID.search(self.log)
        assert match, "the server has not logged its engine core's pid yet"
        return int(match.group(1))

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        """Starts the server and waits until /health says 200; raises if it exits first."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pipellm serve exited with code {self.process.returncode}:\n{self.log[-3000:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pipellm serve did not start within {timeout_s:.0f} s")
            time.sleep(0.2)
        self._remember_descendants()
        return self

    def _healthy(self) -> bool:
        if self.port is None:
            match = LISTENING.search(self.log)
            if not match:
                return False
            self.port = int(match.group(1))
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _remember_descendants(self) -> None:
        assert self.process is not None
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        self._descendants.update((child.pid, child) for child in children)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> list[psutil.Process]:
        """Signals the server, waits for it, and kills it if it hangs. Returns the descendants
        that were still alive EXIT_GRACE_S after it exited (then kills those too)."""
        if self.process is None:
            return []
        if self.process.poll() is None:
            self._remember_descendants()
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        alive = _wait_gone(list(self._descendants.values()), EXIT_GRACE_S)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self._descendants.clear()
        return alive

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Waits until every process has exited; returns those still running at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in processes if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _running(process: psutil.Process) -> bool:
    # A zombie has exited; only its parent (or init) has yet to collect its status.
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
