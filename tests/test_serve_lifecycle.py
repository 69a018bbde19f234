"""`pipellm serve` as processes: pipeline stages, vLLM issue #27462's command line, a killed engine,
signals, startup failures and flag errors. Every test checks that no process outlives it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest

from pipellm import LLM, SamplingParams
from pipellm.entrypoints import cli
from pipellm.testing.server_process import ServerProcess
from tests.checkpoints import make_tiny_checkpoint
from tests.conftest import live_children

pytestmark = pytest.mark.timeout(150)

SMALL_KV_CACHE = ["--kv-cache-memory", str(16 * 2**20)]
PROMPT = "Pipeline parallelism keeps"
# vLLM issue #27462's command line (`vllm serve MODEL ...`), flags unchanged.
SEED_FLAGS = (
    "--trust-remote-code --host 0.0.0.0 --port 8000 --pipeline-parallel-size 8 "
    "--tensor-parallel-size 1 --max-num-seqs 8 --max-cudagraph-capture-size 8 --max-model-len 4042 "
    "--max-num-batched-tokens 32000 --enable-chunked-prefill --kv-cache-dtype auto "
    "--gpu-memory-utilization 0.85 --no-enable-prefix-caching"
).split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def offline_text(checkpoint) -> str:
    """The offline greedy text of PROMPT, 16 tokens: computed once for every case."""
    with LLM(str(checkpoint), kv_cache_memory=16 * 2**20) as llm:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def complete(server: ServerProcess, **kwargs) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    return client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, temperature=0, **kwargs
    )


@pytest.mark.parametrize("victim", ["engine core", "stage 1"])
def test_two_stages_serve_then_exit_1_when_the_engine_dies(
    checkpoint, offline_text, tmp_path, victim
):
    """In-flight requests get an error, the core is reaped (no zombie), and the server exits
    with code 1 within seconds, for a supervisor to restart it (docs/reliability.md)."""
    server = ServerProcess([str(checkpoint), "-pp", "2", *SMALL_KV_CACHE], tmp_path / "log")
    with server:
        out = complete(server, max_tokens=16, extra_body={"ignore_eos": True})
        assert out.choices[0].text == offline_text
        stages = psutil.Process(server.core_pid).children()
        assert len(stages) == 2

        errors: dict[str, BaseException] = {}

        def run(name: str, **kwargs) -> None:
            try:
                out = complete(server, max_tokens=480, extra_body={"ignore_eos": True}, **kwargs)
                if kwargs.get("stream"):
                    for _ in out:
                        pass
            except BaseException as error:  # recorded; the test asserts on it
                errors[name] = error

        threads = [
            threading.Thread(target=run, args=("stream",), kwargs={"stream": True}),
            threading.Thread(target=run, args=("whole",)),
        ]
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # both requests are generating now
        os.kill(server.core_pid if victim == "engine core" else stages[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(timeout=10)
        assert time.monotonic() - killed < 10
        assert not any(thread.is_alive() for thread in threads), "a request hangs"
        assert isinstance(errors["stream"], openai.APIError)
        assert isinstance(errors["whole"], openai.InternalServerError)
        assert "Traceback" not in str(errors["whole"]) and 'File "' not in str(errors["whole"])
        assert server.process.wait(timeout=max(0.1, 10 - (time.monotonic() - killed))) == 1
        if victim == "stage 1":  # the engine core saw the stage die and said so
            assert "pipeline stage 1" in server.log
        # Reaped, not left as zombies (nor orphans) of an exited parent: gone entirely.
        reaped = [server.core_pid, *(stage.pid for stage in stages)]
        deadline = time.monotonic() + 5
        while any(psutil.pid_exists(pid) for pid in reaped) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in reaped if psutil.pid_exists(pid)] == []
        assert server.stop(signal.SIGTERM) == []


def test_seed_command_line_starts_and_sigterm_reaps_everything(tmp_path_factory):
    # Eight stages need eight layers; --max-model-len 4042 needs a longer context.
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny8"), num_layers=8)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    trace = tmp_path_factory.mktemp("trace") / "pipeline.trace.json"
    log = tmp_path_factory.mktemp("logs") / "log"
    server = ServerProcess([str(checkpoint), *SEED_FLAGS, "--trace-file", str(trace)], log)
    with server:
        out = complete(server, max_tokens=8, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        assert len(psutil.Process(server.core_pid).children()) == 8
        # --host 0.0.0.0 opens the HTTP port to the network, and nothing else.
        tree = [
            psutil.Process(server.process.pid),
            *psutil.Process(server.process.pid).children(True),
        ]
        exposed = {
            c.laddr.port
            for p in tree
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1")
        }
        assert exposed == {server.port}
        # Stop while a stream is open: it gets a grace period, then everything is reaped.
        stream = complete(server, max_tokens=400, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        survivors = server.stop(signal.SIGTERM)
        assert server.process.returncode == 0, server.log[-3000:]
        assert survivors == []
        stream.close()
    for flag in ("max_cudagraph_capture_size", "gpu_memory_utilization", "--trust-remote-code"):
        assert server.log.count(flag) == 1, f"{flag} is not reported once"
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == set(range(8))


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--pipeline-parallel-size", "0"], "pipeline_parallel_size=0"),
        (["--max-model-len", "100000"], "max_model_len=100000"),
        (["-pp", "2", "--pp-microbatch-tokens", "0"], "pp_microbatch_tokens=0"),
        (["--port", "70000"], "--port 70000"),
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes 0"),
        (["--distributed-executor-backend", "nope"], "invalid choice"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_exit_2_with_one_line(checkpoint, capsys, flags, words):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", str(checkpoint), *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and words in error, error
    assert live_children() == []  # failed before starting anything


def test_busy_port_exits_2(checkpoint, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", str(checkpoint), "--port", str(port)])
    assert exit_info.value.code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert live_children() == []


def test_engine_that_fails_to_start_exits_1(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in checkpoint.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    command = [sys.executable, "-m", "pipellm.entrypoints.cli", "serve", str(broken), "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "error: the engine failed to start" in result.stderr
