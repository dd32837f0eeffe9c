"""The local backend's process handling with real subprocesses: logs, progress, cancel, down, serve."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from eagle3.config import load_config
from eagle3.pipeline.local import LocalBackend, child_env
from eagle3.pipeline.runstate import RunState
from eagle3.store import open_store
from eagle3.serve.process import ServerProcess, group_alive, proc_cmdline
from tests.waiting import HANG_GUARD_S, until

SCRIPT = """
import json, os, sys, time, signal
signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(143)))
go = sys.argv[2] if len(sys.argv) > 2 else None
for i in range(1, 4):
    print("EAGLE3_PROGRESS " + json.dumps({"stage": "x", "done": i * 10, "total": 30, "unit": "samples"}), file=sys.stderr, flush=True)
    while i == 1 and go and not os.path.exists(go):  # the reader has seen the first line
        time.sleep(0.05)
    if i == 1 and go:
        time.sleep(0.6)  # then at least this long until the next: a rate needs 0.5 s between readings
print("working", flush=True)
time.sleep(float(sys.argv[1]))
"""


@pytest.fixture()
def backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, {"store.uri": f"file://{tmp_path}/store", "run_id": "loc"})
    b = LocalBackend(cfg, RunState(open_store(cfg.store.uri), "loc", tmp_path / ".eagle3/runs/loc"), cancel_grace_s=5)
    return b


def _script_backend(b: LocalBackend, sleep: float, go: Path | None = None) -> None:
    argv = [sys.executable, "-c", SCRIPT, str(sleep), *([str(go)] if go else [])]
    b.stage_command = lambda stage, endpoint=None, force=False: argv  # type: ignore[method-assign]


def _wait(b, h):
    """The stage's outcome, once it has ended (however long that takes)."""
    until(lambda: b.poll(h) is not None)
    return b.poll(h)


def test_a_real_stage_failing_on_missing_upstream_reports_its_error_line(backend):
    h = backend.submit("vocab")
    o = _wait(backend, h)
    assert not o.succeeded
    assert o.reason.startswith("stage vocab needs generate, which is not complete: no manifest at ")
    assert "(log: " in o.reason and o.log_tail[-1].startswith("error: stage vocab needs generate")
    # The child saw the resolved config the scheduler wrote.
    assert "run_id: loc" in backend.config_path.read_text()
    assert backend.stage_command("vocab")[-2:] == ["-c", str(backend.config_path)]
    # A second attempt keeps the first one's log.
    h = backend.submit("vocab")
    _wait(backend, h)
    assert (backend.logs_dir / "vocab.attempt-1.log").exists()
    assert backend.logs("vocab", tail=1)[0].startswith("error: ")


def test_progress_is_parsed_and_cancel_stops_the_process_group(backend, tmp_path):
    go = tmp_path / "go"
    _script_backend(backend, 3600, go)  # runs until cancelled
    backend.cancel_grace_s = 600  # SIGKILL only if SIGTERM were ignored: never while its handler runs
    h = backend.submit("extract")

    def at(n: int) -> bool:
        assert backend.poll(h) is None, "the stage ended before it was cancelled"
        p = backend.progress(h)
        return p is not None and p.done >= n

    until(lambda: at(10))
    go.touch()
    until(lambda: at(30))
    p = backend.progress(h)
    assert (p.done, p.total, p.unit) == (30, 30, "samples") and p.rate and p.rate > 0
    backend.cancel(h)
    o = backend.poll(h)
    # 143: the child's own SIGTERM handler ended it (a SIGKILL would read "signal 9")
    assert o is not None and not o.succeeded and "exit code 143" in o.reason
    assert not group_alive(int(h.ref))


def test_down_from_another_directory_stops_what_the_store_records(backend, tmp_path, monkeypatch):
    _script_backend(backend, 3600)  # runs until stopped
    h = backend.submit("train")
    pid = int(h.ref)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # nothing of the run's local state is here
    other = LocalBackend(backend.cfg, RunState(open_store(backend.cfg.store.uri), "loc"), cancel_grace_s=5)
    removed = other.down()
    assert removed == [f"stage train (process group {pid})"]
    assert not group_alive(pid)
    backend.poll(h)


def test_train_uses_torchrun_for_more_than_one_process(backend):
    backend.cfg.train.nproc_per_node = 2
    cmd = backend.stage_command("train")
    assert cmd[1:6] == ["-m", "eagle3.cli.launch", "--standalone", "--nproc-per-node", "2"]
    assert cmd[6:10] == ["-m", "eagle3", "stage", "train"]
    backend.cfg.train.nproc_per_node = 1
    assert backend.stage_command("train")[1:5] == ["-m", "eagle3", "stage", "train"]
    assert "eagle3.cli.launch" not in backend.stage_command("extract")  # auto: this machine has no GPU
    backend.cfg.extract.nproc_per_node = 2  # extraction deals its shards to the processes
    assert backend.stage_command("extract")[1:6] == ["-m", "eagle3.cli.launch", "--standalone", "--nproc-per-node", "2"]
    backend.cfg.extract.nproc_per_node, backend.cfg.extract.device = "auto", "cpu"
    assert "eagle3.cli.launch" not in backend.stage_command("extract")
    assert "eagle3.cli.launch" not in backend.stage_command("generate")


def test_child_env_drops_config_overrides_but_keeps_the_rest(monkeypatch):
    monkeypatch.setenv("EAGLE3_RUN_ID", "from-env")
    monkeypatch.setenv("EAGLE3_TRAIN__LR", "1")
    monkeypatch.setenv("EAGLE3_DEBUG", "1")
    env = child_env()
    assert "EAGLE3_RUN_ID" not in env and "EAGLE3_TRAIN__LR" not in env
    assert env["EAGLE3_DEBUG"] == "1" and env["PYTHONUNBUFFERED"] == "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_process_waits_for_v1_models_and_stops_for_good(tmp_path):
    (tmp_path / "www/v1").mkdir(parents=True)
    port = _free_port()
    cmd = [sys.executable, "-c", f"import time, subprocess, sys; time.sleep(1); "
           f"subprocess.run([sys.executable, '-m', 'http.server', '{port}', '--bind', '127.0.0.1', '-d', '{tmp_path}/www'])"]
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}/v1", tmp_path / "serve.log", startup_timeout_s=HANG_GUARD_S)
    server.launch()
    (tmp_path / "www/v1/models").write_text('{"data": []}')
    assert server.wait_ready() == f"http://127.0.0.1:{port}/v1"
    server.stop(grace_s=5)
    assert server.proc.poll() is not None and not group_alive(server.pid), "the http.server grandchild too"


def test_server_process_that_dies_while_starting_says_so(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('boom: no model'); sys.exit(3)"]
    server = ServerProcess(cmd, "http://127.0.0.1:9/v1", tmp_path / "serve.log", startup_timeout_s=HANG_GUARD_S,
                           name="transformers server")
    server.launch()
    with pytest.raises(Exception, match=r"transformers server exited with code 3 while starting; see .*: boom: no model"):
        server.wait_ready()


def test_serve_refuses_a_port_another_server_holds(backend):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        backend.cfg.serve.port = s.getsockname()[1]
        with pytest.raises(Exception, match=r"port \d+ on 127.0.0.1 is already in use"):
            backend.start_serve()


def test_down_recognises_a_shebang_script_by_its_recorded_command(backend, tmp_path):
    script = tmp_path / "fake-serve"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(3600)\n")
    script.chmod(0o755)
    server = ServerProcess([str(script), "serve", "--port", "1"], "http://127.0.0.1:1/v1", tmp_path / "s.log")
    server.launch()
    backend.state.update("serve", None, pid=server.pid, cmd=f"{script} serve --port 1")
    # once the script runs (its interpreter shows first in /proc), not while the fork is still pytest
    assert until(lambda: (proc_cmdline(server.pid) or "").endswith(f"{script} serve --port 1"), server.proc)
    assert backend.down() == [f"serve (process group {server.pid})"]
    assert server.proc.wait() is not None
