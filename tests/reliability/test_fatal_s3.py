"""A fatal S3 error mid-stage: the CLI exits with it, and stops what it started first.

The tiny pipeline on the moto S3 server behind ``tests.fault_proxy.FaultProxy``. Once generate
writes its second part, the proxy holds that request (the stage stays mid-stage, blocked in it)
and from then on fails every write of the run's state record, which only ``eagle3ctl`` writes:
its next write spends the retry budget (``store.max_attempts: 2``) and the run ends with that
error. The test then checks, before letting the held request go: the exit is one error line;
no process of the run is alive (the stage and the server were stopped, as Ctrl-C stops them);
no temporary folder of the run is left; the store holds no unfinished upload. Then a rerun
through a healthy proxy completes, ``verify --deep`` passes, and every object under the run is
a committed stage's or the run's own record: the failed attempt left nothing but what the
rerun adopted or swept.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3.manifest import read_manifest
from eagle3.pipeline.local import RUN_TAG, run_tag
from eagle3.serve.process import tagged_groups
from eagle3.stages import ORDER
from eagle3.store import open_store
from tests.fault_proxy import FaultProxy
from tests.fixtures_s3 import MotoS3
from tests.reliability.tiny_run import write_config

pytestmark = [pytest.mark.slow, pytest.mark.s3]

SECOND_PART = re.compile(r"/generate/attempt-[0-9a-f]+(-b)?/parts/part-000001\.jsonl$")


class StateWritesFailAfterSecondPart:
    """The proxy's rule: hold generate's second part; then fail every PUT of ``_run/state.json``."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, method: str, path: str) -> str | None:
        if method == "PUT" and SECOND_PART.search(path.split("?")[0]) and not self.armed:
            self.armed = True
            return "hold"
        if self.armed and method == "PUT" and path.split("?")[0].endswith("/_run/state.json"):
            return "500"
        return None


def test_a_fatal_s3_error_mid_stage_stops_the_stage_and_server_and_leaves_nothing(
        tmp_path: Path, tiny_cache_dir: Path, moto_s3: MotoS3, s3_store_uri: str) -> None:
    config = write_config(tmp_path, "fatal", s3_store_uri, tiny_cache_dir, steps=6, prompts=2)
    settings = yaml.safe_load(config.read_text())
    settings["store"]["max_attempts"] = 2  # the state record's write fails fast, not after ten tries
    config.write_text(yaml.safe_dump(settings))
    temp = tmp_path / "tmp"
    temp.mkdir()
    rule = StateWritesFailAfterSecondPart()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
    with FaultProxy(moto_s3.endpoint, rate=0.0, rule=rule) as proxy:
        env.update(AWS_ENDPOINT_URL=proxy.url, TMPDIR=str(temp))

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "eagle3.cli.app", *args, "-c", str(config)], cwd=tmp_path,
                                  env=env, capture_output=True, text=True, timeout=900)

        r = cli("run", "pipeline")
        try:
            assert rule.armed, "generate never wrote a second part"
            assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
            errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
            assert len(errors) == 1 and "_run/state.json" in errors[0] and "InternalError" in errors[0], r.stderr
            assert "Traceback" not in r.stdout + r.stderr
            store = open_store(s3_store_uri)
            assert tagged_groups(RUN_TAG, run_tag("fatal", store.uri)) == []  # the stage and the server stopped
            assert [p.name for p in temp.iterdir() if p.name.startswith("eagle3-")] == []  # scratch removed
            assert store.partial_writes("fatal") == []  # no unfinished upload
            assert read_manifest(store, "fatal", "generate") is None and store.list("fatal/generate")
        finally:
            proxy.released.set()
        rule.armed = False
        proxy.rule = None
        r = cli("run", "pipeline")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        v = cli("verify", "--deep")
        assert v.returncode == 0, v.stdout + v.stderr
    committed = set()
    for name in ORDER:
        m = read_manifest(store, "fatal", name)
        assert m is not None, name
        committed |= {m.manifest.object_key(o.key) for o in m.manifest.objects} | {f"fatal/{name}/manifest.json"}
    left = [k for k in store.list("fatal") if k not in committed
            and not k.startswith("fatal/_run/") and not k.endswith("/_verified.json")]
    assert left == [] and store.partial_writes("fatal") == []
    generate = read_manifest(store, "fatal", "generate").manifest.stats
    assert generate["resumed"] >= 2, generate  # the part written before the error was adopted, not redone
    assert json.loads(store.get_bytes("fatal/_run/state.json"))["outcome"] == "ok"
