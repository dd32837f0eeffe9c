"""``eagle3-torchrun``: torchrun that keeps a stage's own exit code.

torchrun reports any failed worker as exit 1, so a configuration error (exit 2, which the
Kubernetes Job's ``podFailurePolicy`` turns into ``FailJob`` and the local backend reports
as bad input) looked like a crash worth retrying. This launcher runs torchrun with
``EAGLE3_EXIT_CODE_FILE`` set; a stage process that stops on a known error writes its exit
code there first (:func:`record_exit_code`), and the launcher exits with that code when
torchrun fails. SIGTERM and SIGINT go on to torchrun, which passes them to the workers
(the train stage checkpoints on SIGTERM).

Usage: exactly torchrun's arguments, e.g.
``eagle3-torchrun --standalone --nproc-per-node=8 -m eagle3.cli.stage stage train -c config.yaml``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

EXIT_CODE_FILE = "EAGLE3_EXIT_CODE_FILE"


def record_exit_code(code: int) -> None:
    """Under the launcher: note the exit code this worker stops with (the first worker's wins)."""
    path = os.environ.get(EXIT_CODE_FILE)
    if not path or code == 0:
        return
    try:
        with open(path, "x") as f:
            f.write(f"{code}\n")
    except OSError:  # another worker was first, or the folder is gone: torchrun's own code stands
        pass


def launch(torchrun_args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="eagle3-torchrun-") as tmp:
        code_file = Path(tmp) / "exit_code"
        env = {**os.environ, EXIT_CODE_FILE: str(code_file)}
        child = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun_args], env=env)

        def forward(signum: int, _frame: object) -> None:
            child.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if rc < 0:  # torchrun itself killed by a signal: the shell's convention, 128 + signal
            return 128 - rc
        if rc != 0 and code_file.exists():
            try:
                return int(code_file.read_text().split()[0])
            except (ValueError, IndexError):
                return rc
        return rc


def main() -> None:
    sys.exit(launch(sys.argv[1:]))


if __name__ == "__main__":
    main()
