"""evaluate.engine=vllm: evaluate.vllm's settings and the product's vLLM environment reach ``vllm.LLM``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3 import vllm_env, vllm_version
from eagle3.config import load_config
from eagle3.errors import ConfigError
from eagle3.evaluate import stage as evaluate_stage
from eagle3.evaluate import vllm_engine
from tests.extract.vllm_double import ENGINE_ARGS, LLM_PARAMS


class RecordingLLM:
    """``vllm.LLM`` as far as evaluate uses it: records its arguments and the sampler variable it starts with."""

    kwargs: dict = {}
    sampler_env: str | None = None

    def __init__(self, **kwargs):
        import os

        unknown = set(kwargs) - LLM_PARAMS - ENGINE_ARGS
        assert not unknown, f"vllm.LLM takes no {sorted(unknown)}"
        RecordingLLM.kwargs = kwargs
        RecordingLLM.sampler_env = os.environ.get(vllm_env.FLASHINFER_SAMPLER_ENV)

    def generate(self, prompts, params):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])]) for _ in prompts]

    def get_metrics(self):
        return []


@pytest.fixture(autouse=True)
def _sampler_env_restored(monkeypatch):
    """The engine sets the sampler variable in this process: unset here, as it was after the test."""
    monkeypatch.setenv(vllm_env.FLASHINFER_SAMPLER_ENV, "")
    monkeypatch.delenv(vllm_env.FLASHINFER_SAMPLER_ENV)


def _evaluate(tmp_path, monkeypatch, **overrides):
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: "0.26.0")
    monkeypatch.setattr(vllm_engine, "load_llm_class", lambda: (RecordingLLM, lambda **kw: kw))
    cfg = load_config(None, {"target.model": str(tmp_path), "target.dtype": "bfloat16", "evaluate.engine": "vllm",
                             **overrides})
    ctx = SimpleNamespace(cfg=cfg, upstream_path=lambda stage, name: tmp_path / name)
    evaluate_stage._evaluate_vllm(ctx, [[1, 2, 3]])
    return RecordingLLM.kwargs


def test_defaults_are_vllm_serves(tmp_path, monkeypatch):
    kw = _evaluate(tmp_path, monkeypatch)
    assert (kw["gpu_memory_utilization"], kw["enforce_eager"]) == (0.9, False)  # CUDA graphs, as served
    assert "max_model_len" not in kw  # vLLM's own: the target's context length
    assert kw["tensor_parallel_size"] == 1  # every visible GPU; none here


def test_evaluate_vllm_settings_reach_the_engine(tmp_path, monkeypatch):
    kw = _evaluate(tmp_path, monkeypatch, **{"evaluate.vllm.gpu_memory_utilization": 0.45,
                                             "evaluate.vllm.enforce_eager": True, "evaluate.vllm.max_model_len": 2048,
                                             "evaluate.vllm.tensor_parallel_size": 2})
    assert (kw["gpu_memory_utilization"], kw["enforce_eager"], kw["max_model_len"]) == (0.45, True, 2048)
    assert kw["tensor_parallel_size"] == 2 and kw["dtype"] == "bfloat16"


@pytest.mark.parametrize("key, value", [("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", 0),
                                        ("max_model_len", 0), ("tensor_parallel_size", 0), ("swap_space", 4)])
def test_bad_evaluate_vllm_settings_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=f"evaluate.vllm.{key}"):
        load_config(None, {f"evaluate.vllm.{key}": value})


@pytest.mark.parametrize("installed, preset, want", [(False, None, "0"), (True, None, None), (False, "1", "1")])
def test_flashinfer_sampler_is_off_only_where_flashinfer_is_missing(tmp_path, monkeypatch, installed, preset, want):
    monkeypatch.setattr(vllm_env, "flashinfer_installed", lambda: installed)
    if preset is not None:
        monkeypatch.setenv(vllm_env.FLASHINFER_SAMPLER_ENV, preset)
    _evaluate(tmp_path, monkeypatch)
    assert RecordingLLM.sampler_env == want
