"""extract.engine=vllm against a named double of vllm.LLM: arguments, file layout, shards, resume."""

from __future__ import annotations

import pytest
import torch

from eagle3.context import run_stage
from eagle3.errors import StageError
from eagle3.extract import vllm_engine
from eagle3.extract.shards import read_shard
from eagle3.extract.vllm_plugin import append_final_hidden
from eagle3.store import open_store
from tests.committed import key_of
from tests.extract.pipeline import commit_generate, pipeline_config, random_samples
from tests.extract.vllm_double import SamplingParamsDouble, VllmLLMDouble


@pytest.fixture
def double(monkeypatch):
    VllmLLMDouble.instances.clear()
    monkeypatch.setattr(vllm_engine, "load_llm_class", lambda: (VllmLLMDouble, SamplingParamsDouble))
    monkeypatch.delenv(vllm_engine.FINAL_HIDDEN_ENV, raising=False)
    return VllmLLMDouble


def _shards(cfg, engine):
    store = open_store(cfg.store.uri)
    keys = sorted(store.list(key_of(store, "t", "extract", "shards")))
    return [read_shard(store.local_path(k)) for k in keys]


def test_vllm_engine_writes_the_shards_the_hf_engine_writes(tmp_path, tiny_target_dir, double):
    samples = random_samples(5, vocab=1000)
    runs = {}
    for engine in ("hf", "vllm"):
        cfg = pipeline_config(tmp_path / engine, tiny_target_dir("kimi"), **{
            "extract.engine": engine, "extract.shard_tokens": 60, "extract.storage_dtype": "float32",
            "extract.vllm.hidden_states_dir": str(tmp_path / "hs")})
        (tmp_path / f"gen-{engine}").mkdir()
        commit_generate(cfg, samples, tmp_path / f"gen-{engine}")
        stats = run_stage(cfg, "extract")
        runs[engine] = (cfg, stats)
    assert runs["vllm"][1]["engine"] == "vllm" and runs["vllm"][1]["shards"] == runs["hf"][1]["shards"] > 1
    for a, b in zip(_shards(runs["hf"][0], "hf"), _shards(runs["vllm"][0], "vllm"), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sample_ids, b.sample_ids)
        torch.testing.assert_close(a.aux_hidden, b.aux_hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.final_hidden, b.final_hidden, atol=1e-5, rtol=1e-5)
    store = open_store(runs["vllm"][0].store.uri)
    hf_store = open_store(runs["hf"][0].store.uri)
    hf_head = hf_store.local_path(key_of(hf_store, "t", "extract", "target_head.safetensors")).read_bytes()
    from safetensors.torch import load_file

    got, want = (load_file(str(p)) for p in (store.local_path(key_of(store, "t", "extract", "target_head.safetensors")),
                                              hf_store.local_path(key_of(hf_store, "t", "extract", "target_head.safetensors"))))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert hf_head
    assert not list((tmp_path / "hs").iterdir())  # every connector file read and deleted
    llm = double.instances[-1]
    assert llm.kwargs["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"][:3] \
        == runs["vllm"][1]["aux_layer_ids"]
    assert llm.calls == runs["vllm"][1]["shards"]  # one generate per shard


def test_vllm_engine_resumes_by_shard(tmp_path, tiny_target_dir, double, monkeypatch):
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
    assert VllmLLMDouble.instances[-1].calls == stats["shards"] - 1  # only the shards left


def test_connector_file_that_does_not_match_its_sample_is_an_error(tmp_path, tiny_target_dir, double, monkeypatch):
    cfg = pipeline_config(tmp_path / "s", tiny_target_dir("kimi"), **{
        "extract.engine": "vllm", "extract.vllm.hidden_states_dir": str(tmp_path / "hs")})
    commit_generate(cfg, random_samples(2, vocab=1000), tmp_path)
    real = VllmLLMDouble.generate

    def wrong_tokens(self, prompts, params, **kw):
        return real(self, [{"prompt_token_ids": p["prompt_token_ids"][::-1]} for p in prompts], params, **kw)

    monkeypatch.setattr(VllmLLMDouble, "generate", wrong_tokens)
    with pytest.raises(StageError, match="do not match it: .* token ids differ"):
        run_stage(cfg, "extract")


def test_llm_kwargs_pass_ids_through_in_vllms_convention():
    kw = vllm_engine.llm_kwargs("/m", [2, 30, 58], tmp := __import__("pathlib").Path("/dev/shm/x"), 8, True, 8193,
                                0.9, True)
    assert kw["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2, 30, 58, vllm_engine.FINAL_SLOT]
    assert kw["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": str(tmp)}
    assert kw["tensor_parallel_size"] == 8 and kw["max_num_batched_tokens"] == kw["max_model_len"] == 8193


def test_plugin_hook_appends_the_final_hidden_state():
    h, aux = torch.ones(3, 4), [torch.zeros(3, 4)] * 3
    out_h, out_aux = append_final_hidden(None, (), (h, aux))
    assert out_h is h and len(out_aux) == 4 and out_aux[-1] is h
    assert append_final_hidden(None, (), h) is h  # a model not asked for aux states: untouched


def test_plugin_is_inert_without_its_env(monkeypatch):
    from eagle3.extract import vllm_plugin

    monkeypatch.delenv(vllm_engine.FINAL_HIDDEN_ENV, raising=False)
    vllm_plugin.register()  # would import vllm (absent here) if it acted


def test_without_vllm_the_engine_says_so(monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "vllm" else real_import(name, *a, **k))
    with pytest.raises(StageError, match="extract.engine=vllm needs vLLM .*serve image"):
        vllm_engine.load_llm_class()
