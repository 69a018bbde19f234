"""The two-host harness itself: a shaped link, each host on its own core and in its own memory
cgroup, and nothing left behind on any exit path."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipellm.testing.netns_cluster import TwoHostCluster, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no two-host cluster here: {REASON}")

# What a process on a host reports: its cores, its memory cgroup's limit, its network.
PROBE = """
import os, socket
from pathlib import Path
memory = next(l.split(":", 2)[2] for l in Path("/proc/self/cgroup").read_text().splitlines()
              if "memory" in l.split(":")[1].split(","))
limit = Path("/sys/fs/cgroup/memory" + memory, "memory.limit_in_bytes").read_text().strip()
print(sorted(os.sched_getaffinity(0)), limit, os.readlink("/proc/self/ns/net"))
"""

SEND_UDP = """
import socket, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(20):
    sock.sendto(bytes(1000), ("{address}", 9))
    time.sleep(0.01)
"""


def _qdisc(cluster: TwoHostCluster, host: int) -> str:
    done = subprocess.run(
        [
            "tc",
            "-n",
            cluster.namespaces[host],
            "-s",
            "qdisc",
            "show",
            "dev",
            cluster.interfaces[host],
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _left_behind(cluster: TwoHostCluster) -> list[str]:
    left = [ns for ns in cluster.namespaces if Path(f"/run/netns/{ns}").exists()]
    left += [str(p) for groups in cluster.cgroups for p in groups.values() if p.exists()]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left += [name for name in cluster.interfaces if f" {name}@" in links or f" {name}:" in links]
    return left


def test_hosts_get_a_shaped_link_their_own_core_and_a_memory_limit():
    limit = 300 << 20
    cluster = TwoHostCluster(ray=False, rate="100mbit", memory_limit=limit)
    with cluster:
        for host in (0, 1):
            qdisc = _qdisc(cluster, host)
            assert "qdisc tbf" in qdisc and "rate 100Mbit" in qdisc, qdisc
        seen = [
            cluster.exec(
                h, [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
            ).stdout.split()
            for h in (0, 1)
        ]
        cores = sorted(os.sched_getaffinity(0))
        for host, (affinity, seen_limit, netns) in enumerate(seen):
            assert affinity == f"[{cores[host % len(cores)]}]"
            assert int(seen_limit) == limit
            assert netns != os.readlink("/proc/self/ns/net")
        assert seen[0][2] != seen[1][2]
        # Traffic between the hosts crosses the shaper.
        sent_before = _qdisc(cluster, 1)
        send = SEND_UDP.format(address=cluster.addresses[0])
        cluster.exec(1, [sys.executable, "-c", send], check=True)
        assert _qdisc(cluster, 1) != sent_before
        server = cluster.popen(0, ["sleep", "300"])  # a server still running at the end
        deadline = time.monotonic() + 10
        while server.pid not in cluster.pids(0) and time.monotonic() < deadline:
            time.sleep(0.05)  # its shell joins the cgroups first, then enters the network
        assert server.pid in cluster.pids(0)
    server.wait(timeout=10)
    assert _left_behind(cluster) == []


def test_a_failure_inside_the_cluster_leaves_nothing_behind():
    cluster = TwoHostCluster(ray=False, memory_limit=300 << 20)
    with pytest.raises(RuntimeError, match="boom"), cluster:
        cluster.popen(1, ["sleep", "300"])
        raise RuntimeError("boom")
    assert _left_behind(cluster) == []
    assert cluster.pids(0) == cluster.pids(1) == []
