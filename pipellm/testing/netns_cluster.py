"""A real two-host Ray cluster on one Linux machine, for tests and benchmarks.

Each host is a network namespace (ip-netns(8)) with its own loopback and one end of a veth
pair, so the two hosts reach each other only over 10.213.0.0/24 addresses that exist nowhere
else. The link is shaped like a real one: each end sends through a token-bucket filter
(tc-tbf(8); `rate`, default 1 Gbit/s). Each host runs on its own cores (a cpuset cgroup) and,
given `memory_limit`, in a memory cgroup of that size, as two machines would. A Ray node runs
in each (`ray start --head` in the first, `ray start --address` in the second) with its own
temp dir and --num-cpus. Needs root. Teardown kills every process of the hosts (Ray's agents
ignore SIGTERM), then removes the cgroups, the namespaces and the veth pair, on every path.

Commands enter a host with nsenter(1) --net, not `ip netns exec`: the latter mounts a fresh
/sys, which hides /sys/fs/cgroup, and a process must see its memory limit there (a real host
shows it to its processes).
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
DEFAULT_RATE = "1gbit"
# tbf's bucket and queue as a gigabit NIC's driver would roughly allow (tc-tbf(8)): 32 KiB
# of burst, packets queued for up to 50 ms before being dropped.
TBF_BURST, TBF_LATENCY = "32kb", "50ms"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def unavailable_reason() -> str | None:
    """Why this machine cannot build the cluster, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return f"the `{tool}` tool is not installed"
    for controller in ("cpuset", "memory"):
        if not (CGROUP_ROOT / controller / "cgroup.procs").exists():
            return f"no cgroup v1 `{controller}` controller under {CGROUP_ROOT}"
    probe = f"pipellm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def own_cgroup(controller: str) -> Path:
    """This process's cgroup of a v1 controller: the hosts' cgroups nest under it, so they
    stay inside whatever limits this process already runs under."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return CGROUP_ROOT / controller / path.lstrip("/")
    raise RuntimeError(f"this process is in no cgroup of the {controller} controller")


class TwoHostCluster:
    """`with TwoHostCluster(num_cpus=1) as cluster:` two Ray hosts; `cluster.exec(0, ...)` runs
    a command on the first host (with `driver_env()`, a Ray driver there joins the cluster).
    `ray=False` builds the two hosts' network only. `rate`: the link's speed each way (tc's
    units: 1gbit, 10gbit; None leaves it unshaped); `cores`: each host's CPUs (default: host
    k gets core k, modulo the machine's); `memory_limit`: bytes each host's processes may use
    together (a memory cgroup; None: no limit)."""

    def __init__(
        self,
        num_cpus: int = 1,
        ray: bool = True,
        rate: str | None = DEFAULT_RATE,
        cores: list[list[int]] | None = None,
        memory_limit: int | None = None,
    ) -> None:
        self.ray = ray
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"pipellm-h0-{tag}", f"pipellm-h1-{tag}"]
        self.interfaces = [f"plv{tag}a", f"plv{tag}b"]  # interface names: 15 chars at most
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.num_cpus = num_cpus
        self.rate = rate
        machine = sorted(os.sched_getaffinity(0))
        self.cores = cores or [[machine[h % len(machine)]] for h in range(2)]
        self.memory_limit = memory_limit
        controllers = ["cpuset"] + (["memory"] if memory_limit is not None else [])
        # host -> its cgroup directory per controller
        self.cgroups = [
            {c: own_cgroup(c) / f"pipellm-h{h}-{tag}" for c in controllers} for h in range(2)
        ]
        self.started: list[subprocess.Popen] = []
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
            self._make_cgroups()
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
            if self.rate is not None:  # egress of each end: both directions shaped
                shape = ["rate", self.rate, "burst", TBF_BURST, "latency", TBF_LATENCY]
                _run(["tc", "-n", ns, "qdisc", "add", "dev", interface, "root", "tbf", *shape])

    def _make_cgroups(self) -> None:
        for host, groups in enumerate(self.cgroups):
            for controller, path in groups.items():
                path.mkdir()
                if controller == "cpuset":
                    parent = path.parent
                    (path / "cpuset.mems").write_text((parent / "cpuset.mems").read_text())
                    cpus = ",".join(map(str, self.cores[host]))
                    (path / "cpuset.cpus").write_text(cpus)
                else:
                    (path / "memory.limit_in_bytes").write_text(str(self.memory_limit))

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

    def command(self, host: int, command: list[str], cgroups: bool = True) -> list[str]:
        """`command` as run on a host: in its cgroups (children stay in them; with
        cgroups=False, in its network only, as a client on another machine), then in its
        network namespace."""
        in_network = ["nsenter", f"--net=/run/netns/{self.namespaces[host]}", "--", *command]
        if not cgroups:
            return in_network
        join = "".join(
            f"echo $$ > {path / 'cgroup.procs'}; " for path in self.cgroups[host].values()
        )
        return ["sh", "-c", f'{join}exec "$@"', "sh", *in_network]

    def exec(self, host: int, command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        """Runs a command on a host with the cluster's token auth."""
        return subprocess.run(
            self.command(host, command), env=self.host_env(kwargs.pop("env", None)), **kwargs
        )

    def popen(self, host: int, command: list[str], **kwargs: object) -> subprocess.Popen:
        """Starts a command on a host (a server); close() kills it with the host's processes."""
        process = subprocess.Popen(
            self.command(host, command), env=self.host_env(kwargs.pop("env", None)), **kwargs
        )
        self.started.append(process)  # killed by close() even before it joined its host
        return process

    def host_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        ray_bin = str(Path(sys.executable).parent)
        env = dict(self.env, PATH=f"{ray_bin}:{self.env.get('PATH', '')}")
        env.update(extra or {})
        return env

    def driver_env(self) -> dict[str, str]:
        """What a driver on host 0 needs to join the cluster."""
        return {"RAY_ADDRESS": self.ray_address}

    def pids(self, host: int) -> list[int]:
        """Every process of the host: in its network namespace or its cgroups."""
        done = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True)
        pids = {int(p) for p in done.stdout.split()}
        for path in self.cgroups[host].values():
            try:
                pids.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except OSError:  # not made (yet), or removed
                continue
        return sorted(pids)

    def raylet_pid(self, host: int) -> int:
        for pid in self.pids(host):
            try:
                if b"raylet/raylet" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        raise RuntimeError(f"no raylet runs on host {host}")

    def close(self) -> None:
        """Kills every process on both hosts, then removes their cgroups and namespaces and
        the veth pair; safe to repeat."""
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.wait()
        for host, ns in enumerate(self.namespaces):
            deadline = time.monotonic() + 10.0
            while (pids := self.pids(host)) and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            for path in self.cgroups[host].values():
                # A cgroup can go only once its last process has been reaped.
                while path.exists() and time.monotonic() < deadline + 10.0:
                    try:
                        path.rmdir()
                    except OSError:
                        time.sleep(0.1)
            if Path(f"/run/netns/{ns}").exists():
                _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.interfaces[0], check=False)  # made, but never moved
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ip(*args: str, check: bool = True) -> None:
    _run(["ip", *args], check)


def _run(command: list[str], check: bool = True) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")
