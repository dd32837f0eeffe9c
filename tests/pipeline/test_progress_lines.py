"""Progress lines of ranks sharing one stderr pipe (a torchrun stage) stay whole lines.

Without care two ranks' lines run into one: stderr on a pipe is write-through, and print() writes the
text and its newline separately.
"""

from __future__ import annotations

import os
import subprocess
import sys

from eagle3.progress import parse_progress

RANKS, LINES = 4, 2000
EMIT = f"""
import os
from eagle3.progress import emit_progress
for i in range({LINES}):
    emit_progress({{"stage": "extract", "done": i, "total": {LINES}, "unit": "tokens", "rank": int(os.environ["RANK"])}})
"""


def test_ranks_writing_progress_at_once_never_share_a_line():
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", EMIT], stderr=write, env={**os.environ, "RANK": str(r)})
             for r in range(RANKS)]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    records = [parse_progress(line) for line in lines]
    assert len(lines) == RANKS * LINES and all(records)
    for r in range(RANKS):
        assert [x["done"] for x in records if x["rank"] == r] == list(range(LINES))
