"""eagle3-torchrun: torchrun that keeps a stage's exit code and passes SIGTERM on to the workers."""

import os
import signal
import subprocess
import sys

from tests.fixtures_targets import free_port
from tests.waiting import until


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3.cli.launch", "--nproc-per-node=2", f"--master-port={free_port()}", *args]


def test_a_config_error_under_torchrun_exits_2_not_1(tmp_path):
    missing = tmp_path / "missing.yaml"
    run = subprocess.run(launcher("-m", "eagle3.cli.stage", "stage", "extract", "-c", str(missing)),
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert run.returncode == 2, run.stderr[-3000:]
    assert [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")], run.stderr[-3000:]
    # Plain torchrun, for contrast: the same failure is its generic 1.
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                            f"--master-port={free_port()}", "-m", "eagle3.cli.stage", "stage", "extract", "-c", str(missing)],
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert plain.returncode == 1


def test_success_and_crashes_keep_torchrun_codes(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("print('worker ok')\n")
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('boom')\n")  # no recorded code: torchrun's own failure code
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert subprocess.run(launcher(str(ok)), env=env, capture_output=True).returncode == 0
    assert subprocess.run(launcher(str(crash)), env=env, capture_output=True).returncode == 1


def test_sigterm_reaches_the_workers(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'stopped-' + os.environ['LOCAL_RANK']), 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"open(os.path.join({str(tmp_path)!r}, 'ready-' + os.environ['LOCAL_RANK']), 'w').close()\n"
        "time.sleep(3600)\n"  # until stopped
    )
    proc = subprocess.Popen(launcher(str(worker)), env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert until(lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)), proc), "workers did not start"
        proc.send_signal(signal.SIGTERM)  # what Kubernetes sends the pod's main process
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
    assert all((tmp_path / f"stopped-{r}").exists() for r in (0, 1))  # e.g. train checkpoints here
