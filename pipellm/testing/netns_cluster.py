"""A real two-host Ray cluster on one Linux machine, for tests and benchmarks.

Each host is a network namespace (ip-netns(8)) with its own loopback and one end of a veth
pair, so the two hosts reach each other only over 10.213.0.0/24 addresses that exist nowhere
else. A Ray node runs in each (`ray start --head` in the first, `ray start --address` in the
second) with its own temp dir and --num-cpus. Needs root. Teardown kills every process in the
namespaces (Ray's agents ignore SIGTERM) and deletes the namespaces, on every path.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY_PORT = 6379  # free in a fresh namespace
SUBNET = "10.213.0"
START_TIMEOUT_S = 120.0


def unavailable_reason() -> str | None:
    """Why this machine cannot build the cluster, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"pipellm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoHostCluster:
    """`with TwoHostCluster(num_cpus=1) as cluster:` two Ray hosts; `cluster.exec(0, ...)` runs
    a command on the first host (with `driver_env()`, a Ray driver there joins the cluster).
    `ray=False` builds the two hosts' network only."""

    def __init__(self, num_cpus: int = 1, ray: bool = True) -> None:
        self.ray = ray
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"pipellm-h0-{tag}", f"pipellm-h1-{tag}"]
        self.interfaces = [f"plv{tag}a", f"plv{tag}b"]  # interface names: 15 chars at most
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.num_cpus = num_cpus
        self.temp_dir = Path(tempfile.mkdtemp(prefix="pipellm-netns-"))
        # Token authentication, as `ray start --head` enables by default, with a token of the
        # cluster's own: a fresh machine has no ~/.ray/auth_token, and a user's stays untouched.
        token = self.temp_dir / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        for inherited in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
            self.env.pop(inherited, None)

    @property
    def ray_address(self) -> str:
        return f"{self.addresses[0]}:{RAY_PORT}"

    def __enter__(self) -> TwoHostCluster:
        try:
            self._make_network()
            if self.ray:
                self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_network(self) -> None:
        if0, if1 = self.interfaces
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", if0, "type", "veth", "peer", "name", if1)
        for ns, interface, address in zip(
            self.namespaces, self.interfaces, self.addresses, strict=True
        ):
            _ip("link", "set", interface, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", ns, "link", "set", interface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _start_ray(self) -> None:
        common = ["--num-cpus", str(self.num_cpus), "--disable-usage-stats"]
        head = ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
        worker = ["--address", self.ray_address]
        for host, extra in enumerate((head, worker)):
            temp = self.temp_dir / f"h{host}"
            temp.mkdir()
            command = ["ray", "start", *extra, "--node-ip-address", self.addresses[host]]
            command += [*common, "--temp-dir", str(temp)]
            done = self.exec(host, command, capture_output=True, text=True, timeout=START_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"ray start on host {host} failed:\n{done.stderr[-3000:]}")

    def exec(self, host: int, command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        """Runs a command on a host (in its namespace) with the cluster's token auth."""
        ray_bin = str(Path(sys.executable).parent)
        env = dict(self.env, PATH=f"{ray_bin}:{self.env.get('PATH', '')}")
        env.update(kwargs.pop("env", None) or {})
        in_namespace = ["ip", "netns", "exec", self.namespaces[host], *command]
        return subprocess.run(in_namespace, env=env, **kwargs)

    def driver_env(self) -> dict[str, str]:
        """What a driver on host 0 needs to join the cluster."""
        return {"RAY_ADDRESS": self.ray_address}

    def pids(self, host: int) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True)
        return [int(p) for p in done.stdout.split()]

    def raylet_pid(self, host: int) -> int:
        for pid in self.pids(host):
            try:
                if b"raylet/raylet" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        raise RuntimeError(f"no raylet runs on host {host}")

    def close(self) -> None:
        """Kills every process on both hosts, then deletes the namespaces; safe to repeat."""
        for host, ns in enumerate(self.namespaces):
            if not Path(f"/run/netns/{ns}").exists():
                continue
            deadline = time.monotonic() + 10.0
            while (pids := self.pids(host)) and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.interfaces[0], check=False)  # made, but never moved
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ip(*args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
