"""The supported vLLM range: declared once, read without importing vLLM, the same in pyproject and the image."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from eagle3 import vllm_version
from eagle3.errors import StageError
from eagle3.extract.vllm_plugin import PLUGIN_RELEASES
from eagle3.vllm_version import is_supported, parse_version, require_vllm

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, want", [("0.26.0", (0, 26, 0)), ("0.34.1rc1", (0, 34, 1)), ("0.30.0+cu129", (0, 30, 0)),
                                        ("0.35.0.dev3+g1234", (0, 35, 0)), ("v0.22.1", (0, 22, 1)), ("1.0", (1, 0, 0))])
def test_parse_version(text, want):
    assert parse_version(text) == want


def test_the_range_is_0_22_1_to_every_0_34():
    assert [is_supported(parse_version(v)) for v in ("0.22.0", "0.22.1", "0.26.0", "0.34.0", "0.34.9", "0.35.0",
                                                     "1.0.0")] == [False, True, True, True, True, False, False]
    with pytest.raises(ValueError):
        parse_version("nightly")


@pytest.mark.parametrize("installed, said", [(None, "none is installed here"), ("0.21.0", "installed: 0.21.0"),
                                             ("0.35.0", "installed: 0.35.0"), ("main", "says its version is 'main'")])
def test_require_vllm_is_one_line_naming_the_range(monkeypatch, installed, said):
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: installed)
    with pytest.raises(StageError) as e:
        require_vllm("serve.engine=vllm")
    assert str(e.value).startswith("serve.engine=vllm needs vLLM 0.22.1 to 0.34.x") and said in str(e.value)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: "0.26.0")
    assert require_vllm("x") == (0, 26, 0)


def test_installed_vllm_reads_metadata_only():
    assert vllm_version.installed_vllm() is None  # not installed on CPU machines; and nothing was imported
    import sys

    assert "vllm" not in sys.modules


def test_pyproject_and_the_serve_image_say_the_same_range():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [vllm_version.REQUIREMENT]
    newest = ".".join(map(str, vllm_version.NEWEST_MINOR))
    for path in ("images/serve.Dockerfile", "scripts/build-images.sh"):
        pins = re.findall(r"vllm/vllm-openai:v([\d.]+)", (REPO / path).read_text())
        assert pins and all(p.startswith(newest + ".") for p in pins), path
    assert is_supported(PLUGIN_RELEASES[0]) and is_supported(PLUGIN_RELEASES[1])
