"""The CLI as a newcomer meets it: --version, -h, a bare command, install hints, `init` that runs as printed,
image names that say they are the user's to build."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import derived_run_id, load_config
from eagle3.stages import ORDER

runner = CliRunner()


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_version_help_and_a_bare_command():
    from importlib.metadata import version

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"eagle3ctl {version('eagle3ctl')}"
    for argv in ([], ["-h"], ["--help"]):
        r = runner.invoke(app, argv, prog_name="eagle3ctl")
        assert r.exit_code == 0 and "Usage: eagle3ctl [OPTIONS] COMMAND" in r.output and "verify" in r.output, argv
    for argv in (["run"], ["run", "-h"], ["status", "-h"], ["run", "pipeline", "-h"], ["show", "-h"]):
        r = runner.invoke(app, argv, prog_name="eagle3ctl")
        assert r.exit_code == 0 and f"Usage: eagle3ctl {argv[0]}" in r.output, argv


def test_the_installed_command_prints_its_version():
    """The console script itself, as a shell runs it (bare: the help and exit 0)."""
    exe = Path(sys.executable).with_name("eagle3ctl")
    bare = subprocess.run([str(exe)], capture_output=True, text=True)
    assert bare.returncode == 0 and "Usage: eagle3ctl" in bare.stdout
    assert re.fullmatch(r"eagle3ctl \d+\.\d+\.\d+\S*\n", subprocess.run([str(exe), "--version"], capture_output=True,
                                                                         text=True).stdout)


def test_install_hints_name_a_command_that_works_from_a_checkout(monkeypatch):
    from eagle3.errors import ConfigError
    from eagle3.k8s.render import render_chart

    monkeypatch.setitem(sys.modules, "helm_python", None)  # as if the k8s extra were not installed
    with pytest.raises(ConfigError) as e:
        render_chart({}, "r", "ns")
    assert "pip install -e '.[k8s]'" in str(e.value) and "eagle3ctl[k8s]" not in str(e.value)


def test_default_images_name_a_placeholder_registry_everywhere():
    """Settings, chart values and the Kimi example agree; docs/images.md says the images are the user's."""
    from eagle3.k8s.render import CHART_DIR
    from eagle3.settings.kubernetes import PLACEHOLDER_REGISTRY, KubernetesSettings

    s = KubernetesSettings()
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["images"]
    assert (values["gpu"], values["cpu"], values["serve"]) == (s.image, s.cpu_image, s.serve_image)
    assert all(x.startswith(PLACEHOLDER_REGISTRY + "/") for x in (s.image, s.cpu_image, s.serve_image))
    repo = Path(__file__).resolve().parents[2]
    kimi = yaml.safe_load((repo / "examples/kimi-k2.5.yaml").read_text())["kubernetes"]
    assert kimi["image"] == s.image and kimi["cpu_image"] == s.cpu_image and kimi["serve_image"] == s.serve_image
    images_md = (repo / "docs/images.md").read_text()
    assert "you build them and push them to a registry" in images_md and PLACEHOLDER_REGISTRY in images_md


def test_a_kubernetes_run_on_placeholder_images_is_refused_before_anything_starts(workdir):
    r = runner.invoke(app, ["run", "pipeline", "--run-id", "k", "--store", f"file://{workdir}/s", "--backend", "kubernetes"])
    assert r.exit_code == 2
    assert r.output.strip() == ("error: kubernetes.image, kubernetes.cpu_image, kubernetes.serve_image: "
                                "registry.example.com/eagle3 is a placeholder; build and push the images to your "
                                "registry (docs/images.md) and name them in the config")
    assert not (workdir / "s").exists()


def test_init_writes_a_config_that_passes_every_check_for_its_model(workdir, tiny_cache_dir):
    """builtin:tiny-llama has 1,024 tokens: the draft vocab is derived, not the default 32,000 that
    would be refused; run_id stays unset, so the run is named after the file as documented."""
    r = runner.invoke(app, ["init", "e.yaml", "--model", "builtin:tiny-llama"])
    assert r.exit_code == 0, r.output
    assert "vocab.draft_vocab_size: 1024, the target's whole vocab (the default 32000 exceeds it)" in r.output
    assert r.output.strip().splitlines()[-1] == (f"wrote e.yaml, run {derived_run_id(workdir / 'e.yaml')} (named after "
                                                 f"the file; set run_id in it to choose a name); run it with: "
                                                 f"eagle3ctl run pipeline -c e.yaml")
    cfg = load_config(workdir / "e.yaml")
    assert cfg.run_id == derived_run_id(workdir / "e.yaml") and cfg.vocab.draft_vocab_size == 1024
    from eagle3.pipeline.preflight import check_run

    check_run(cfg.model_copy(update={"target": cfg.target.model_copy(update={"cache_dir": str(tiny_cache_dir)})}),
              set(ORDER))  # what `run pipeline -c e.yaml` checks before it starts anything


def test_init_reads_a_local_target_and_refuses_a_missing_one(workdir, tiny_llama_dir):
    r = runner.invoke(app, ["init", "local.yaml", "--model", str(tiny_llama_dir), "--run-id", "l"])
    assert r.exit_code == 0, r.output
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    assert load_config(workdir / "local.yaml").vocab.draft_vocab_size == vocab
    r = runner.invoke(app, ["init", "missing.yaml", "--model", str(workdir / "models/nope")])
    assert r.exit_code == 2 and r.output.strip() == f"error: target.model: no such folder: {workdir / 'models/nope'}"
    assert not (workdir / "missing.yaml").exists()
    r = runner.invoke(app, ["init", "hub.yaml", "--model", "moonshotai/Kimi-K2.5"])
    assert r.exit_code == 0 and "not on this machine; vocab.draft_vocab_size stays 32000" in r.output
    assert load_config(workdir / "hub.yaml").vocab.draft_vocab_size == 32000


def test_the_builtin_targets_vocab_is_known_before_they_are_built(tiny_llama_dir):
    from eagle3.targets.tiny import tiny_vocab_size

    assert tiny_vocab_size("llama") == json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]


def test_init_makes_no_folder(workdir):
    r = runner.invoke(app, ["init", "sub/dir/e.yaml", "--model", "moonshotai/Kimi-K2.5"])
    assert r.exit_code == 2 and r.output.strip() == "error: folder sub/dir does not exist; create it first"
    assert list(workdir.iterdir()) == []
