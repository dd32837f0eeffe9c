"""How the product starts ``vllm serve``: vLLM's CLI module under this interpreter locally (a vLLM installed
with ``pip install --target`` has no ``vllm`` on PATH), the serve image's ``vllm`` on Kubernetes, and the
FlashInfer sampler off where FlashInfer is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle3 import vllm_env
from eagle3.serve.vllm import IMAGE_VLLM, VLLM_CLI_MODULE, vllm_command
from eagle3.settings.serve import ServeSettings
from eagle3.settings.target import TargetSettings

# vLLM's console-script module as 0.22.1-0.34.x ship it (vllm/entrypoints/cli/main.py ends in
# ``if __name__ == "__main__": main()``), reduced to recording what it was run with.
CLI_DOUBLE = '''import json, os, sys


def main():
    with open(os.environ["RECORD"], "w") as f:
        json.dump({"argv": sys.argv[1:], "sampler": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")}, f)


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def site_without_path(tmp_path):
    """A vLLM installed beside the environment (``pip install --target``): importable, no ``vllm`` on PATH."""
    site = tmp_path / "vllm-site"
    pkg = site / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (site / "vllm", site / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(CLI_DOUBLE)
    return site


def test_local_vllm_serve_runs_without_vllm_on_path(tmp_path, site_without_path, monkeypatch):
    monkeypatch.setattr(vllm_env, "flashinfer_installed", lambda: False)
    cmd = vllm_command(ServeSettings(port=8123, reasoning_parser="kimi_k2"), TargetSettings(model="/m", dtype="bfloat16"),
                       "/m")
    assert cmd[:4] == [sys.executable, "-m", VLLM_CLI_MODULE, "serve"]
    parent = {k: v for k, v in os.environ.items() if k != vllm_env.FLASHINFER_SAMPLER_ENV}
    env = {**parent, "PATH": "/nonexistent", "PYTHONPATH": str(site_without_path), "RECORD": str(tmp_path / "r.json")}
    subprocess.run(cmd, env={**env, **vllm_env.vllm_env(env)}, check=True, timeout=60)
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["argv"] == cmd[3:] and got["argv"][:2] == ["serve", "/m"] and "--reasoning-parser" in got["argv"]
    assert got["sampler"] == "0"


def test_kubernetes_runs_the_serve_images_vllm():
    cmd = vllm_command(ServeSettings(port=8000), TargetSettings(model="/m"), "/m", IMAGE_VLLM)
    assert cmd[:3] == ["vllm", "serve", "/m"]


@pytest.mark.parametrize("installed, environ, want", [
    (False, {}, {"VLLM_USE_FLASHINFER_SAMPLER": "0"}),
    (True, {}, {}),
    (False, {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, {}),  # the user's setting stands
])
def test_flashinfer_sampler_env(monkeypatch, installed, environ, want):
    monkeypatch.setattr(vllm_env, "flashinfer_installed", lambda: installed)
    assert vllm_env.vllm_env(environ) == want


def test_the_in_image_launcher_passes_the_sampler_env(tmp_path, monkeypatch):
    from eagle3 import vllm_version
    from eagle3.k8s.serve import server_argv

    path = tmp_path / "c.yaml"
    path.write_text("run_id: r\nbackend: kubernetes\ntarget: {model: /models/x}\nserve: {engine: vllm}\n"
                    "kubernetes: {gpus_per_node: 1}\n")
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: "0.26.0")
    monkeypatch.setattr(vllm_env, "flashinfer_installed", lambda: False)
    monkeypatch.delenv(vllm_env.FLASHINFER_SAMPLER_ENV, raising=False)
    argv, env = server_argv(str(path))
    assert argv[:3] == ["vllm", "serve", "/models/x"] and env == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
