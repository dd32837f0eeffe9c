"""Every stage as its own container of the CPU image, with the store on the moto S3 server.

The way a backend runs them: ``eagle3 stage NAME -c /config/run.yaml`` in the image, the
config mounted read-only, S3 credentials only in the environment, the root filesystem
read-only. ``generate`` talks to ``transformers serve`` running in a container of the same
image (started by ``python -m eagle3.k8s.serve``, the server entrypoint the chart uses);
the containers share the host network so they reach the servers on 127.0.0.1. At the end
``eagle3ctl verify --deep`` (in the image) checks every manifest, sha256 and content.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest
import yaml

from tests.containers.docker import StageRunner, wait_for_models
from tests.fixtures_s3 import MotoS3

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(3600)]

RUN_ID = "ctr"
STAGES_AFTER_GENERATE = ("vocab", "extract", "train", "export", "evaluate")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_config(store_uri: str, port: int) -> dict:
    """A run small enough for 2 CPU cores: a few prompts, short answers, a few train steps."""
    return {
        "run_id": RUN_ID,
        "store": {"uri": store_uri},
        "target": {"model": "builtin:tiny-llama", "cache_dir": "/eagle3-cache/targets", "dtype": "float32"},
        "serve": {"endpoint": f"http://127.0.0.1:{port}/v1", "host": "127.0.0.1", "port": port,
                  "engine": "transformers", "startup_timeout_s": 300},
        "generate": {"max_samples": 6, "max_tokens": 24, "concurrency": 3, "part_size": 4, "max_length": 256},
        "vocab": {"draft_vocab_size": 256},
        "extract": {"device": "cpu", "batch_tokens": 512, "shard_tokens": 256, "storage_dtype": "bfloat16"},
        "train": {"max_steps": 4, "batch_tokens": 128, "ttt_steps": 2, "warmup_steps": 1, "checkpoint_every": 2,
                  "log_every": 1, "device": "cpu", "nproc_per_node": 1, "eval_fraction": 0.0},
        "evaluate": {"num_prompts": 2, "max_new_tokens": 12, "num_draft_tokens": 3, "device": "cpu"},
    }


@pytest.fixture(scope="module")
def store_uri(moto_s3: MotoS3) -> str:
    return f"s3://{moto_s3.bucket}/containers-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def runner(cpu_image: str, moto_s3: MotoS3, store_uri: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[StageRunner]:
    config_dir = tmp_path_factory.mktemp("config")
    cache_dir = tmp_path_factory.mktemp("cache")
    # The image runs as uid 10001: the config is world-readable, the cache world-writable.
    config_dir.chmod(0o755)
    cache_dir.chmod(0o777)
    port = _free_port()
    (config_dir / "run.yaml").write_text(yaml.safe_dump(_tiny_config(store_uri, port)))
    (config_dir / "run.yaml").chmod(0o644)
    r = StageRunner(cpu_image, config_dir, cache_dir, env=moto_s3.env())
    r.port = port  # type: ignore[attr-defined]
    yield r
    r.stop_all()


def _stage(runner: StageRunner, name: str) -> str:
    res = runner.run(["stage", name, "-c", "/config/run.yaml"])
    assert res.returncode == 0, res.explain()
    assert "Traceback" not in res.stderr, res.explain()
    return res.stderr


def _manifest_keys(moto_s3: MotoS3, store_uri: str) -> set[str]:
    prefix = store_uri.split("/", 3)[3]
    listed = moto_s3.client().list_objects_v2(Bucket=moto_s3.bucket, Prefix=f"{prefix}/{RUN_ID}/")
    return {o["Key"][len(prefix) + 1:] for o in listed.get("Contents", []) if o["Key"].endswith("/manifest.json")}


def test_image_runs_as_non_root(runner: StageRunner) -> None:
    res = runner.run(["-c", "import os, torch, eagle3; print(os.getuid(), os.getgid(), torch.__version__)"],
                     entrypoint="python")
    assert res.returncode == 0, res.explain()
    uid, gid, torch_version = res.stdout.split()
    assert (uid, gid) == ("10001", "10001")
    assert torch_version.endswith("+cpu")


def test_generate_against_transformers_serve_in_a_container(runner: StageRunner, moto_s3: MotoS3,
                                                              store_uri: str) -> None:
    server = runner.start(["-m", "eagle3.k8s.serve", "-c", "/config/run.yaml"], entrypoint="python")
    try:
        models = wait_for_models(f"http://127.0.0.1:{runner.port}/v1", runner, server)  # type: ignore[attr-defined]
        assert models and models[0].startswith("/eagle3-cache/targets/")
        err = _stage(runner, "generate")
        assert "stage generate: committed" in err
    finally:
        runner.stop(server)  # as the pipeline does: serve goes away once generate commits
    assert "ctr/generate/manifest.json" in _manifest_keys(moto_s3, store_uri)


@pytest.mark.parametrize("stage", STAGES_AFTER_GENERATE)
def test_stage_in_its_own_container(runner: StageRunner, moto_s3: MotoS3, store_uri: str, stage: str) -> None:
    assert "ctr/generate/manifest.json" in _manifest_keys(moto_s3, store_uri), "generate did not commit"
    err = _stage(runner, stage)
    assert f"stage {stage}: committed" in err
    assert f"ctr/{stage}/manifest.json" in _manifest_keys(moto_s3, store_uri)


def test_rerun_skips_a_complete_stage(runner: StageRunner) -> None:
    err = _stage(runner, "vocab")
    assert "committed" not in err  # manifest complete for the same input key: nothing rewritten


def test_wrong_credentials_fail_in_one_line(runner: StageRunner) -> None:
    res = runner.run(["stage", "vocab", "-c", "/config/run.yaml", "--force"],
                     env={"AWS_SECRET_ACCESS_KEY": "wrong-secret"})
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.explain()
    assert "S3 refused the credentials" in lines[0], res.explain()
    assert "wrong-secret" not in res.stdout + res.stderr  # secrets never echoed


def test_verify_deep_checks_every_manifest(runner: StageRunner, moto_s3: MotoS3, store_uri: str) -> None:
    keys = _manifest_keys(moto_s3, store_uri)
    assert keys == {f"ctr/{s}/manifest.json" for s in ("generate", *STAGES_AFTER_GENERATE)}
    res = runner.run(["verify", "--deep", "-c", "/config/run.yaml"], entrypoint="eagle3ctl")
    assert res.returncode == 0, res.explain()
    for stage in ("generate", *STAGES_AFTER_GENERATE):
        assert f"{stage}: ok" in res.stdout, res.explain()


def test_the_image_launches_torchrun_keeping_a_config_errors_exit_code(runner: StageRunner) -> None:
    """The chart runs extract and train as ``eagle3-torchrun …``: a bad config ends the pod with 2
    (the Job's podFailurePolicy: FailJob), not torchrun's generic 1 (retried)."""
    res = runner.run(["--standalone", "--nproc-per-node=2", "-m", "eagle3.cli.stage", "stage", "extract",
                      "-c", "/config/missing.yaml"], entrypoint="eagle3-torchrun")
    assert res.returncode == 2, res.explain()
    assert "error: " in res.stderr, res.explain()
