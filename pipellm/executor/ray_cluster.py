"""Which Ray the stages run on, and where on it: join a cluster or start a private one; place.

Join or start (the rule of `ray.init` itself, made explicit): with RAY_ADDRESS set ("auto" finds
a Ray already running on this host) pipellm joins that cluster, passes no resources and never
stops it. Otherwise it starts a private Ray with explicit CPUs, no dashboard and a temp dir of
its own, and at shutdown ends every process of it: Ray's agents (ray::DashboardAgent,
ray::RuntimeEnvAgent) may outlive `ray.shutdown()` and ignore SIGTERM, so survivors get SIGKILL.

Placement: one placement-group bundle per rank (a stage, or one tensor-parallel rank of it),
PACK by default, so neighbouring stages share a host when they fit and spread when they do not
(Ray's placement groups: https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html).
Stages take the bundles host by host, so stage k+1 runs on stage k's host whenever that host
holds both; with tensor parallelism a stage takes T bundles of one host whenever one has T
left, so that its all-reduces stay in shared memory (across hosts they go over gloo).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from pipellm.config import EngineConfig

PLACEMENT_TIMEOUT_S = 60.0  # a cluster busy with other jobs may free resources meanwhile
REAP_GRACE_S = 3.0  # how long Ray's own shutdown gets before survivors are killed


class RayClusterError(RuntimeError):
    """The Ray cluster cannot run the pipeline (not reachable, or not enough resources)."""


@dataclass
class RayConnection:
    """The Ray this executor uses; `private` when pipellm started it (and must stop it)."""

    private: bool
    connected_here: bool  # this executor called ray.init (and so disconnects again)
    address: str
    temp_dir: str | None = None
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, start time)


def connect(num_ranks: int) -> RayConnection:
    """Joins the cluster RAY_ADDRESS names, or starts a private local Ray (a CPU per rank at
    least)."""
    import ray

    if ray.is_initialized():  # the caller connected already: use it, never stop it
        return RayConnection(private=False, connected_here=False, address=_gcs_address())
    address = os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except Exception as error:
            raise RayClusterError(
                f"could not join the Ray cluster at RAY_ADDRESS={address!r}: {error}. Start it "
                "with `ray start --head` (and `ray start --address HEAD:PORT` on the other "
                "hosts); if it uses token authentication, set RAY_AUTH_MODE=token and give this "
                "host its token (docs/multinode.md); unset RAY_ADDRESS for a private local Ray"
            ) from error
        return RayConnection(private=False, connected_here=True, address=_gcs_address())
    temp_dir = tempfile.mkdtemp(prefix="pipellm-ray-")
    ray.init(
        num_cpus=max(num_ranks, os.cpu_count() or 1),
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
    )
    connection = RayConnection(True, True, _gcs_address(), temp_dir)
    connection.processes = _processes_of(temp_dir)
    return connection


def disconnect(connection: RayConnection) -> None:
    """Leaves a joined cluster running (only disconnects); stops a private Ray and every
    process of it."""
    import ray

    if not connection.private:
        if connection.connected_here:
            ray.shutdown()  # a driver's disconnect: the cluster's processes are not ours
        return
    # Workers and agents started since connect.
    connection.processes = _processes_of(connection.temp_dir, connection.processes)
    ray.shutdown()
    deadline = time.monotonic() + REAP_GRACE_S
    while any(_alive(p) for p in connection.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, started in connection.processes:
        if _alive((pid, started)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if connection.temp_dir is not None:
        shutil.rmtree(connection.temp_dir, ignore_errors=True)


def stage_bundle(config: EngineConfig) -> dict[str, float]:
    """What one stage reserves: its threads' CPUs (1 unless --num-threads)."""
    return {"CPU": float(config.num_threads or 1)}


def place_stages(num_stages: int, bundle: dict[str, float], strategy: str = "PACK") -> Any:
    """Reserves one bundle per stage (per rank with tensor parallelism: `num_stages` counts
    them), or raises RayClusterError within PLACEMENT_TIMEOUT_S."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()
    missing = [
        f"{num_stages} x {amount:g} {name} (the cluster has {total.get(name, 0):g})"
        for name, amount in bundle.items()
        if total.get(name, 0) < num_stages * amount
    ]
    if missing:
        raise RayClusterError(
            f"the Ray cluster cannot hold {num_stages} pipeline stages (ranks): they need "
            f"{', '.join(missing)}. Add hosts (`ray start --address ...`), give them more "
            "(`ray start --num-cpus N`), or lower --pipeline-parallel-size or "
            "--tensor-parallel-size"
        )
    group = placement_group([dict(bundle)] * num_stages, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except Exception as error:
        remove_placement_group(group)
        raise RayClusterError(
            f"the Ray cluster could not place {num_stages} pipeline stages of {bundle} "
            f"({strategy}) within {PLACEMENT_TIMEOUT_S:g} s: available now "
            f"{_summary(ray.available_resources())} of {_summary(total)} (other jobs hold the "
            "rest, or no single host fits a bundle)"
        ) from error
    return group


def stage_order(bundle_nodes: dict[int, str], first_node: str | None) -> list[int]:
    """Bundle indices in stage order: host by host (`first_node`'s first), so neighbours share."""
    hosts: list[str] = []
    for index in sorted(bundle_nodes):
        if bundle_nodes[index] not in hosts:
            hosts.append(bundle_nodes[index])
    if first_node in hosts:
        hosts.remove(first_node)
        hosts.insert(0, first_node)
    return [i for host in hosts for i in sorted(bundle_nodes) if bundle_nodes[i] == host]


def rank_order(bundle_nodes: dict[int, str], first_node: str | None, tp_size: int) -> list[int]:
    """Bundle indices in rank order (rank = stage x T + tensor-parallel rank): stages host by
    host as in stage_order, each stage's T ranks on one host whenever some host has T bundles
    left; the bundles left over on each host (fewer than T) go, in host order, to the stages
    that fit nowhere whole (those all-reduce over gloo)."""
    order = stage_order(bundle_nodes, first_node)
    if tp_size == 1:
        return order
    by_host: dict[str, list[int]] = {}
    for index in order:
        by_host.setdefault(bundle_nodes[index], []).append(index)
    whole, left = [], []
    for indices in by_host.values():
        cut = len(indices) - len(indices) % tp_size
        whole += indices[:cut]
        left += indices[cut:]
    return whole + left


def bundle_nodes(group: Any) -> dict[int, str]:
    """Which node holds each bundle of a ready placement group."""
    from ray.util import placement_group_table

    return {int(k): v for k, v in placement_group_table(group)["bundles_to_node_id"].items()}


def _gcs_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def _summary(resources: dict[str, float]) -> str:
    kinds = ("CPU", "GPU")
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in kinds)


# ---- the processes of a private Ray ---------------------------------------------------------


def _processes_of(temp_dir: str | None, known: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """This process's children that belong to the Ray under `temp_dir`, and all their
    descendants (agents and workers rename themselves ray::..., so they are found by parent)."""
    if temp_dir is None:
        return list(known)
    table = _process_table()
    roots = {
        pid
        for pid, (ppid, _, cmdline) in table.items()
        if ppid == os.getpid() and temp_dir in cmdline
    }
    found, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _, _) in table.items() if ppid == parent]
        found.update(children)
        frontier.extend(children)
    result = {(pid, table[pid][1]) for pid in found} | set(known)
    return sorted(result)


def _process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time in clock ticks, command line), from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        table[int(entry)] = (int(fields[1]), int(fields[19]), cmdline)
    return table


def _alive(process: tuple[int, int]) -> bool:
    """Still running and still the same process (a pid may be reused)."""
    pid, started = process
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[19]) == started and fields[0] != "Z"
