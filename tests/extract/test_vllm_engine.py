"""extract.engine=vllm against named doubles of vLLM 0.22.1, 0.26.0 and 0.34.0: the path each release
takes, the dtype, file layout, shards equal to the hf engine's, resume, and the plugin's safety."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from eagle3 import vllm_env, vllm_version
from eagle3.context import run_stage
from eagle3.errors import StageError
from eagle3.extract import vllm_engine, vllm_plugin
from eagle3.extract.shards import read_shard
from eagle3.extract.vllm_plugin import append_final_hidden
from eagle3.store import open_store
from eagle3.targets.aux_layers import FINAL_SLOT
from tests.committed import key_of
from tests.extract.pipeline import commit_generate, pipeline_config, random_samples
from tests.extract.vllm_double import RELEASES, SamplingParamsDouble, VllmLLMDouble


def _clear_env(monkeypatch, *names: str) -> None:
    """Unset for the test and restored after it, even when the code under test sets them."""
    for name in names:
        monkeypatch.setitem(os.environ, name, "")
        monkeypatch.delitem(os.environ, name)


@pytest.fixture
def vllm(monkeypatch):
    """Selects the vLLM release the doubles follow (``vllm("0.26.0")``) and installs it."""
    VllmLLMDouble.instances.clear()
    _clear_env(monkeypatch, vllm_plugin.FINAL_HIDDEN_ENV, vllm_engine.V2_RUNNER_ENV, vllm_env.FLASHINFER_SAMPLER_ENV)
    monkeypatch.setattr(vllm_engine, "load_llm_class", lambda: (VllmLLMDouble, SamplingParamsDouble))

    def use(version: str) -> type[VllmLLMDouble]:  # a machine with this vLLM: a fresh environment
        for name in (vllm_plugin.FINAL_HIDDEN_ENV, vllm_engine.V2_RUNNER_ENV):
            os.environ.pop(name, None)
        monkeypatch.setattr(VllmLLMDouble, "release", RELEASES[version])
        monkeypatch.setattr(vllm_version, "installed_vllm", lambda: version)
        return VllmLLMDouble

    return use


def _shards(cfg):
    store = open_store(cfg.store.uri)
    keys = sorted(store.list(key_of(store, "t", "extract", "shards")))
    return [read_shard(store.local_path(k)) for k in keys]


def _extract(tmp_path: Path, target_dir: Path, name: str, samples, **overrides):
    cfg = pipeline_config(tmp_path / name, target_dir, **{
        "extract.shard_tokens": 60, "extract.storage_dtype": "float32", "target.dtype": "float32",
        "extract.vllm.hidden_states_dir": str(tmp_path / "hs"), **overrides})
    (tmp_path / f"gen-{name}").mkdir()
    commit_generate(cfg, samples, tmp_path / f"gen-{name}")
    return cfg, run_stage(cfg, "extract")


# (target, release) -> how the final hidden state arrives: vLLM's id L (before the norm), or the plugin's slot
PATHS = {("llama", "0.22.1"): "id L", ("llama", "0.26.0"): "id L", ("llama", "0.34.0"): "id L",
         ("kimi", "0.22.1"): "plugin", ("kimi", "0.26.0"): "id L", ("kimi", "0.34.0"): "id L"}


@pytest.mark.parametrize("arch", ["llama", "kimi"])
def test_every_release_writes_the_shards_the_hf_engine_writes(tmp_path, tiny_target_dir, vllm, arch):
    samples = random_samples(5, vocab=1000)
    hf_cfg, hf_stats = _extract(tmp_path, tiny_target_dir(arch), "hf", samples, **{"extract.engine": "hf"})
    hf_shards = _shards(hf_cfg)
    for version in RELEASES:
        llm_cls = vllm(version)
        cfg, stats = _extract(tmp_path, tiny_target_dir(arch), version, samples, **{"extract.engine": "vllm"})
        assert stats["shards"] == hf_stats["shards"] > 1 and stats["target_dtype"] == "float32"
        for a, b in zip(hf_shards, _shards(cfg), strict=True):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sample_ids, b.sample_ids)
            torch.testing.assert_close(a.aux_hidden, b.aux_hidden, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.final_hidden, b.final_hidden, atol=1e-5, rtol=1e-5)  # after the norm
        llm = llm_cls.instances[-1]
        ids = llm.kwargs["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        final = "id L" if ids[-1] == 6 else "plugin" if ids[-1] == FINAL_SLOT else ids[-1]
        assert (ids[:3], final) == (hf_stats["aux_layer_ids"], PATHS[arch, version]), version
        assert llm.kwargs["dtype"] == "float32" and llm.dtype == torch.float32
        assert type(llm.runner).__name__ == ("ModelRunnerV2Double" if version == "0.34.0" else "GPUModelRunner")
        assert os.environ.get(vllm_plugin.FINAL_HIDDEN_ENV) == ("1" if final == "plugin" else None)
        assert llm.calls == stats["shards"]  # one generate per shard
        assert not list((tmp_path / "hs").iterdir())  # every connector file read and deleted
    store, hf_store = open_store(cfg.store.uri), open_store(hf_cfg.store.uri)
    from safetensors.torch import load_file

    got, want = (load_file(str(s.local_path(key_of(s, "t", "extract", "target_head.safetensors"))))
                 for s in (store, hf_store))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("installed, want", [(False, "0"), (True, None)])
def test_the_flashinfer_sampler_is_off_where_flashinfer_is_missing(tmp_path, tiny_target_dir, vllm, monkeypatch,
                                                                   installed, want):
    monkeypatch.setattr(vllm_env, "flashinfer_installed", lambda: installed)
    vllm("0.26.0")
    _extract(tmp_path, tiny_target_dir("llama"), "x", random_samples(2, vocab=1000), **{"extract.engine": "vllm"})
    assert os.environ.get(vllm_env.FLASHINFER_SAMPLER_ENV) == want  # set before vllm.LLM: its processes inherit it


def test_the_dtype_reaches_vllm_and_auto_is_vllms_own_rule(tmp_path, tiny_target_dir, vllm):
    llm_cls = vllm("0.26.0")
    samples = random_samples(2, vocab=1000)
    _, stats = _extract(tmp_path, tiny_target_dir("llama"), "auto", samples,
                        **{"extract.engine": "vllm", "target.dtype": "auto", "extract.storage_dtype": "bfloat16"})
    llm = llm_cls.instances[-1]
    # The tiny target's config says float32: vLLM's auto serves it in bfloat16, and so does extract.
    assert llm.kwargs["dtype"] == "bfloat16" == stats["target_dtype"] and llm.dtype == torch.bfloat16
    for dtype in ("float16", "float32"):
        _, stats = _extract(tmp_path, tiny_target_dir("llama"), dtype, samples,
                            **{"extract.engine": "vllm", "target.dtype": dtype})
        assert llm_cls.instances[-1].kwargs["dtype"] == dtype == stats["target_dtype"]


def test_a_dropped_dtype_would_change_the_hidden_states(tmp_path, tiny_target_dir, vllm, monkeypatch):
    """What the dtype test guards: vLLM's auto is not the float32 the hf engine ran in."""
    vllm("0.26.0")
    real = vllm_engine.llm_kwargs
    monkeypatch.setattr(vllm_engine, "llm_kwargs", lambda *a: {k: v for k, v in real(*a).items() if k != "dtype"})
    samples = random_samples(3, vocab=1000)
    hf_cfg, _ = _extract(tmp_path, tiny_target_dir("llama"), "hf", samples, **{"extract.engine": "hf"})
    cfg, _ = _extract(tmp_path, tiny_target_dir("llama"), "vllm", samples, **{"extract.engine": "vllm"})
    a, b = _shards(hf_cfg)[0], _shards(cfg)[0]
    assert not torch.allclose(a.final_hidden, b.final_hidden, atol=1e-5, rtol=1e-5)


def _double(vllm, version: str, target_dir: Path, ids: list[int], tmp_path: Path,
            v2_runner_env: str | None = None) -> VllmLLMDouble:
    vllm(version)
    if v2_runner_env is not None:
        os.environ[vllm_engine.V2_RUNNER_ENV] = v2_runner_env
    (tmp_path / "hs").mkdir(exist_ok=True)
    kwargs = vllm_engine.llm_kwargs(str(target_dir), ids, tmp_path / "hs", 1, False, 64, 0.9, True, "float32")
    return VllmLLMDouble(**kwargs)


def test_the_plugin_slot_is_what_v2_refuses(tmp_path, tiny_target_dir, vllm):
    """Given the plugin's id list, vLLM 0.34 (V2 only) fails on the first request, as 0.33 did with the
    plugin; it refuses the V1 runner the plugin would need outright: those releases take the id-L path."""
    llm = _double(vllm, "0.34.0", tiny_target_dir("kimi"), [2, 3, 5, FINAL_SLOT], tmp_path)
    with pytest.raises(ValueError, match="Expected 4 auxiliary hidden states, got 3"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParamsDouble(max_tokens=1))
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported"):
        _double(vllm, "0.34.0", tiny_target_dir("kimi"), [2, 3, 5, 6], tmp_path, v2_runner_env="0")


def test_a_deepseek_target_on_0_22_captures_no_id_l(tmp_path, tiny_target_dir, vllm):
    """Why 0.22.1-0.24 need the plugin for DeepseekV2-family targets: id L is never captured, and
    V1's proposer fails on 3 states for 4 slots; a Llama target gives all four."""
    llm = _double(vllm, "0.22.1", tiny_target_dir("kimi"), [2, 3, 5, 6], tmp_path)
    with pytest.raises(RuntimeError, match="size"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParamsDouble(max_tokens=1))
    llm = _double(vllm, "0.22.1", tiny_target_dir("llama"), [2, 3, 5, 6], tmp_path)
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParamsDouble(max_tokens=1))
    with pytest.raises(NotImplementedError, match="extract_hidden_states is not supported yet"):  # 0.22.1's V2
        _double(vllm, "0.22.1", tiny_target_dir("llama"), [2, 3, 5, 6], tmp_path, v2_runner_env="1")


def test_vllm_engine_resumes_by_shard(tmp_path, tiny_target_dir, vllm, monkeypatch):
    llm_cls = vllm("0.34.0")
    cfg = pipeline_config(tmp_path / "s", tiny_target_dir("kimi"), **{
        "extract.engine": "vllm", "extract.shard_tokens": 60, "extract.vllm.hidden_states_dir": str(tmp_path / "hs")})
    commit_generate(cfg, random_samples(5, vocab=1000), tmp_path)
    real = vllm_engine.extract_shard_vllm
    calls = []

    def dies_on_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise StageError("killed")
        return real(*a, **kw)

    monkeypatch.setattr(vllm_engine, "extract_shard_vllm", dies_on_second)
    with pytest.raises(StageError, match="killed"):
        run_stage(cfg, "extract")
    monkeypatch.setattr(vllm_engine, "extract_shard_vllm", real)
    stats = run_stage(cfg, "extract")
    assert stats["shards_adopted"] == 1 and stats["shards"] >= 2
    assert llm_cls.instances[-1].calls == stats["shards"] - 1  # only the shards left


def test_connector_file_that_does_not_match_its_sample_is_an_error(tmp_path, tiny_target_dir, vllm, monkeypatch):
    vllm("0.22.1")
    cfg = pipeline_config(tmp_path / "s", tiny_target_dir("kimi"), **{
        "extract.engine": "vllm", "extract.vllm.hidden_states_dir": str(tmp_path / "hs")})
    commit_generate(cfg, random_samples(2, vocab=1000), tmp_path)
    real = VllmLLMDouble.generate

    def wrong_tokens(self, prompts, params, **kw):
        return real(self, [{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts], params, **kw)

    monkeypatch.setattr(VllmLLMDouble, "generate", wrong_tokens)
    with pytest.raises(StageError, match="do not match it: .* token ids differ"):
        run_stage(cfg, "extract")


@pytest.mark.parametrize("installed, said", [(None, "none is installed"), ("0.35.0", "installed: 0.35.0"),
                                             ("0.22.0", "installed: 0.22.0"), ("nightly", "says its version")])
def test_extract_refuses_a_vllm_outside_the_range_first(tmp_path, tiny_target_dir, monkeypatch, installed, said):
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: installed)
    monkeypatch.setattr(vllm_engine, "load_llm_class", lambda: pytest.fail("vLLM was started"))
    cfg = pipeline_config(tmp_path / "s", tiny_target_dir("llama"), **{"extract.engine": "vllm"})
    commit_generate(cfg, random_samples(2, vocab=1000), tmp_path)
    with pytest.raises(StageError, match=f"extract.engine=vllm needs vLLM 0.22.1 to 0.34.x.*{said}"):
        run_stage(cfg, "extract")


def test_a_family_vllm_is_not_known_for_is_refused():
    from eagle3.targets.load import JsonConfig

    with pytest.raises(StageError, match="model_type 'gpt_oss': use extract.engine=hf"):
        vllm_engine.final_by_layer_id(JsonConfig(model_type="gpt_oss"), (0, 34, 0))
    kimi = JsonConfig(model_type="kimi_k25", text_config={"model_type": "deepseek_v3"})
    assert [vllm_engine.final_by_layer_id(kimi, v) for v in ((0, 22, 1), (0, 24, 0), (0, 25, 0), (0, 34, 0))] == \
        [False, False, True, True]
    assert vllm_engine.final_by_layer_id(JsonConfig(model_type="llama"), (0, 22, 1))


def test_llm_kwargs_pass_ids_and_dtype_through():
    kw = vllm_engine.llm_kwargs("/m", [2, 30, 58, 61], Path("/dev/shm/x"), 8, True, 8193, 0.9, True, "bfloat16")
    assert kw["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2, 30, 58, 61]
    assert kw["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": "/dev/shm/x"}
    assert kw["tensor_parallel_size"] == 8 and kw["max_num_batched_tokens"] == kw["max_model_len"] == 8193
    assert kw["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_norm_is_transformers_rmsnorm(dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = (torch.randn(7, 64) * 3).to(dtype)
    for cls in (LlamaRMSNorm, DeepseekV3RMSNorm):
        norm = cls(64, eps=1e-6).to(dtype)
        torch.nn.init.normal_(norm.weight)
        ours = vllm_engine.FinalNorm(norm.weight.detach().float(), 1e-6)(x)
        assert ours.dtype == dtype and torch.equal(ours, norm(x).detach())


def test_plugin_hook_appends_the_final_hidden_state():
    h, aux = torch.ones(3, 4), [torch.zeros(3, 4)] * 3
    out_h, out_aux = append_final_hidden(None, (), (h, aux))
    assert out_h is h and len(out_aux) == 4 and out_aux[-1] is h
    assert append_final_hidden(None, (), h) is h  # a model not asked for aux states: untouched


@pytest.mark.parametrize("version", ["0.25.0", "0.26.0", "0.33.0", "0.34.0", None])
def test_plugin_never_acts_on_a_release_that_needs_none(monkeypatch, capsys, version):
    """vLLM calls general plugins without a try: on releases with id L (0.34 has no V1 runner to
    import) the plugin returns before importing anything, even when its env is set."""
    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: version)
    monkeypatch.setenv(vllm_plugin.FINAL_HIDDEN_ENV, "1")
    vllm_plugin.register()  # would import vllm (absent here) if it acted
    assert "is ignored on vLLM" in capsys.readouterr().err
    monkeypatch.delenv(vllm_plugin.FINAL_HIDDEN_ENV)
    vllm_plugin.register()
    assert capsys.readouterr().err == ""


def test_plugin_module_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, eagle3.extract.vllm_plugin as p; p.register(); "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != vllm_plugin.FINAL_HIDDEN_ENV})
    assert out.stdout.strip() == "[]"


def test_without_vllm_the_engine_says_so(monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "vllm" else real_import(name, *a, **k))
    with pytest.raises(StageError, match="extract.engine=vllm needs vLLM .*serve image"):
        vllm_engine.load_llm_class()
