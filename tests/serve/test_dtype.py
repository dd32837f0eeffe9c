"""target.dtype reaches every engine the product starts: vllm serve, transformers serve, extract and
evaluate in vLLM, the hf engines; ``auto`` is one rule (vLLM's on a GPU) resolved to a concrete dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3 import vllm_version
from eagle3.errors import Eagle3Error
from eagle3.serve.local import transformers_serve_command
from eagle3.settings.serve import ServeSettings
from eagle3.serve.vllm import vllm_command
from eagle3.targets.load import JsonConfig, load_target_model, target_dtype
from eagle3.settings.target import TargetSettings

SERVE = ServeSettings(host="0.0.0.0", port=8000)


@pytest.mark.parametrize("config, cuda, cpu", [
    ({"dtype": "float32"}, "bfloat16", "float32"),  # vLLM downcasts a float32 config on a GPU
    ({"torch_dtype": "float16"}, "float16", "float16"),
    ({"dtype": "bfloat16"}, "bfloat16", "bfloat16"),
    ({}, "bfloat16", "float32"),
    ({"model_type": "kimi_k25", "text_config": {"dtype": "bfloat16"}}, "bfloat16", "bfloat16"),
])
def test_auto_is_one_rule(config, cuda, cpu):
    auto = TargetSettings(model="m")
    assert target_dtype(auto, "cuda", JsonConfig(config)) == cuda
    assert target_dtype(auto, "cpu", JsonConfig(config)) == cpu
    assert target_dtype(TargetSettings(model="m", dtype="float16"), "cuda", JsonConfig(config)) == "float16"


def _flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, cmd
    return cmd[cmd.index(name) + 1]


def test_vllm_serve_always_gets_the_dtype(tiny_llama_dir):
    local = str(tiny_llama_dir)
    assert _flag(vllm_command(SERVE, TargetSettings(model=local), local), "--dtype") == "bfloat16"
    assert _flag(vllm_command(SERVE, TargetSettings(model=local, dtype="float32"), local), "--dtype") == "float32"
    # A hub id the CLI cannot read: `auto`, which vLLM resolves by the very rule target_dtype follows on a GPU.
    hub = TargetSettings(model="moonshotai/Kimi-K2.5")
    assert _flag(vllm_command(SERVE, hub, hub.model), "--dtype") == "auto"
    assert _flag(vllm_command(SERVE, TargetSettings(model=hub.model, dtype="bfloat16"), hub.model), "--dtype") == \
        "bfloat16"


def test_the_kimi_example_serves_in_its_dtype():
    from eagle3.config import load_config
    from eagle3.k8s.render import serve_command

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "kimi-k2.5.yaml",
                      {"backend": "kubernetes", "kubernetes.gpus_per_node": 8})
    assert _flag(serve_command(cfg), "--dtype") == cfg.target.dtype == "bfloat16"


def test_transformers_serve_gets_the_resolved_dtype(tiny_llama_dir):
    auto = transformers_serve_command(TargetSettings(model=str(tiny_llama_dir)), SERVE, device="cpu")
    assert _flag(auto.argv, "--dtype") == "float32"  # on CPU: the config's
    bf16 = transformers_serve_command(TargetSettings(model=str(tiny_llama_dir), dtype="bfloat16"), SERVE, device="cpu")
    assert _flag(bf16.argv, "--dtype") == "bfloat16"


def test_the_hf_engines_load_the_same_dtype(tiny_llama_dir):
    assert load_target_model(TargetSettings(model=str(tiny_llama_dir)), "cpu").dtype == torch.float32
    model = load_target_model(TargetSettings(model=str(tiny_llama_dir), dtype="bfloat16"), "cpu")
    assert model.dtype == torch.bfloat16


def test_the_serve_launcher_checks_the_vllm_version_first(tmp_path, monkeypatch):
    from eagle3.k8s.serve import server_argv

    path = tmp_path / "c.yaml"
    path.write_text("run_id: r\nbackend: kubernetes\ntarget: {model: /models/x}\nserve: {engine: vllm}\n"
                    "kubernetes: {gpus_per_node: 1}\n")
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: "0.35.0")
    with pytest.raises(Eagle3Error, match="serve.engine=vllm needs vLLM 0.22.1 to 0.34.x; installed: 0.35.0"):
        server_argv(str(path))
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: "0.34.0")
    argv, _ = server_argv(str(path))
    assert argv[:3] == ["vllm", "serve", "/models/x"] and _flag(argv, "--dtype") == "auto"


@dataclass
class _Metric:
    name: str
    value: int = 0
    values: tuple = ()


class _RecordingLLM:
    """Records what ``vllm.LLM`` is given; answers as vLLM's LLM.generate / get_metrics do."""

    kwargs: dict = {}

    def __init__(self, **kwargs):
        _RecordingLLM.kwargs = kwargs

    def generate(self, prompts, params):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2])]) for _ in prompts]

    def get_metrics(self):
        return [_Metric("vllm:spec_decode_num_drafts", 2), _Metric("vllm:spec_decode_num_draft_tokens", 6),
                _Metric("vllm:spec_decode_num_accepted_tokens", 3),
                _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=(2, 1, 0))]


def test_evaluate_in_vllm_gets_the_dtype_extract_ran_in(tmp_path, tiny_llama_dir, monkeypatch):
    from eagle3.config import load_config
    from eagle3.evaluate import stage as evaluate_stage
    from eagle3.evaluate import vllm_engine

    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: "0.26.0")
    monkeypatch.setattr(vllm_engine, "load_llm_class", lambda: (_RecordingLLM, lambda **kw: kw))
    for dtype, want in (("auto", "bfloat16"), ("float32", "float32")):
        cfg = load_config(None, {"target.model": str(tiny_llama_dir), "target.dtype": dtype, "evaluate.engine": "vllm",
                                 "evaluate.num_draft_tokens": 3})
        ctx = SimpleNamespace(cfg=cfg, upstream_path=lambda stage, name: tmp_path / name)
        report = evaluate_stage._evaluate_vllm(ctx, [[1, 2, 3]])
        assert _RecordingLLM.kwargs["dtype"] == want == evaluate_stage._engine_dtype(cfg)
        assert _RecordingLLM.kwargs["speculative_config"]["num_speculative_tokens"] == 3
        assert report["mean_acceptance_length"] == 2.5
