"""Stages on two real hosts: two network namespaces joined by a veth pair, a Ray node in each."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from pipellm import LLM
from pipellm.testing.netns_cluster import TwoHostCluster, unavailable_reason
from tests.multihost_driver import GREEDY, PROMPTS

pytest.importorskip("ray")
REASON = unavailable_reason()
ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "multihost_driver.py"
MIB = 1 << 20
ROOMY = 16 << 30


@pytest.mark.skipif(REASON is not None, reason=f"no two-host cluster here: {REASON}")
def test_two_hosts_serve_give_one_process_tokens_and_a_dead_host_is_a_clear_error(tmp_path, reaped):
    """One cluster start for all of it (the suite's time): `pipellm serve` across the hosts
    and its orderly stop, then offline runs: the greedy tokens with each host's memory below
    the whole model's need, the whole model refused on one host, a host frozen while idle, a
    host's death mid-run."""
    # The reference: one process on this host (stages give its greedy tokens: test_smollm2),
    # which spawns no stage processes for the suite's time.
    with LLM() as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
    expected = [o.outputs[0].token_ids for o in outputs]
    # Each host's processes in a memory cgroup: roomy for `pipellm serve`, then lowered by the
    # driver to between what half the model and the whole model need on top of what runs.
    with TwoHostCluster(num_cpus=1, memory_limit=ROOMY) as cluster:
        pid_file = tmp_path / "raylet.pid"
        pid_file.write_text(str(cluster.raylet_pid(1)))
        cgroups = json.dumps([str(groups["memory"]) for groups in cluster.cgroups])
        done = cluster.exec(
            0,
            [
                sys.executable,
                str(DRIVER),
                str(pid_file),
                str(tmp_path),
                cluster.namespaces[1],
                cgroups,
            ],
            env={**cluster.driver_env(), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(report, indent=1))
        runs = (report["served"]["stages"], report["stages"], report["stages_again"])
        stage_pids = [stage["pid"] for stages in runs for stage in stages]
        left = [pid for host in (0, 1) for pid in cluster.pids(host) if pid in stage_pids]
    # `pipellm serve --distributed-executor-backend ray -pp 2`, its stages one per host: the
    # offline greedy text, and Ctrl-C ends it (exit 0) with nothing left behind.
    served = report["served"]
    assert [s["name"] for s in served["stages"]] == ["pipeline stage 0", "pipeline stage 1"]
    assert [s["address"] for s in served["stages"]] == cluster.addresses
    assert len({s["netns"] for s in served["stages"]}) == 2
    assert served["text"] == outputs[0].outputs[0].text == report["texts"][0]
    assert served["exit_code"] == 0 and served["survivors"] == []
    # One stage per host: each ran in its own namespace, at its own address.
    assert [s["address"] for s in report["stages"]] == cluster.addresses
    assert len({s["netns"] for s in report["stages"]}) == 2
    # Half the model fits on each host, so -pp 2 across them serves the reference tokens;
    # the whole model on one host is refused before loading, naming the host, need and limit.
    assert report["tokens"] == expected
    limit = report["memory_limit"]
    assert limit["half"] < limit["whole"]
    refused = report["whole_model"]["error"] or "no error"
    host = re.match(r"out of memory: host 10\.213\.0\.([12]) \(", refused)
    assert host, refused  # on whichever host Ray placed it
    assert f"needs {limit['whole'] / MIB:.1f} MiB" in refused
    host_limit = limit["limits"][int(host.group(1)) - 1]
    assert f"memory limit is {host_limit / MIB:.1f} MiB (cgroup " in refused
    assert "need 3 x 1 CPU (the cluster has 2)" in report["too_big"]["error"]
    # A frozen host never answers, and Ray declares it dead only after its node health check
    # (15 s or more): the engine's idle ping round names it first.
    frozen = report["frozen"]["error"] or "no error"
    assert frozen.startswith("pipeline stage 1 (host 10.213.0.2, pid "), frozen
    assert "did not answer a ping" in frozen
    assert "pipeline stage 1" in report["killed"]["error"], report["killed"]
    assert report["killed"]["seconds"] < 10
    assert not left, f"stage processes outlived the run: {left}"
