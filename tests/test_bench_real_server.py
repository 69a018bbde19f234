"""`pipellm bench serve` against the real `pipellm serve` (two pipeline stages): no failures,
and the figures agree with what the server counted."""

import json
import subprocess
import sys

from pipellm.testing.server_process import ServerProcess
from tests.checkpoints import make_tiny_checkpoint


def test_bench_serve_against_pipellm_serve(tmp_path, reaped):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny")
    flags = [str(checkpoint), "-pp", "2", "--max-num-seqs", "8", "--kv-cache-memory", str(2**24)]
    with ServerProcess(flags, tmp_path / "server.log") as server:
        bench = [sys.executable, "-m", "pipellm.entrypoints.cli", "bench", "serve"]
        bench += ["--base-url", server.base_url, "--tokenizer", str(checkpoint)]
        bench += ["--dataset-name", "random", "--num-prompts", "24", "--max-concurrency", "6"]
        bench += ["--random-input-len", "40", "--random-output-len", "12", "--num-warmups", "2"]
        bench += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
        run = subprocess.run(bench, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Serving Benchmark Result" in run.stdout
        server.stop()
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 24 and result["failed"] == 0
    assert result["total_input_tokens"] == 24 * 40
    assert result["total_output_tokens"] == 24 * 12, "ignore_eos: exactly the asked length"
    assert 1 <= result["max_concurrent_requests"] <= 6
