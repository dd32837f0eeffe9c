import json

import pytest
import torch

from eagle3.context import run_stage
from eagle3.extract import stage as extract_stage
from eagle3.extract.shards import INDEX, TARGET_HEAD, read_shard
from eagle3.manifest import read_manifest, verify_stage
from eagle3.store import open_store
from eagle3.targets.aux_layers import default_aux_layer_ids
from tests.extract.pipeline import commit_generate, pipeline_config, random_samples
from tests.committed import attempt_key, flip_in_place, key_of


def _shards(store, run_id="t"):
    m = read_manifest(store, run_id, "extract").manifest
    return m, [read_shard(store.local_path(key_of(store, run_id, "extract", f"{k}"))) for k in m.keys("shards/")]


@pytest.mark.parametrize("arch,storage", [("llama", "bfloat16"), ("deepseek", "float8_e4m3fn")])
def test_extract_writes_consistent_shards(tmp_path, tiny_target_dir, arch, storage):
    cfg = pipeline_config(tmp_path / "store", tiny_target_dir(arch), **{
        "extract.shard_tokens": 100, "extract.batch_tokens": 64, "extract.storage_dtype": storage})
    samples = random_samples(12)
    commit_generate(cfg, samples, tmp_path)
    stats = run_stage(cfg, "extract")
    store = open_store(cfg.store.uri)
    m, shards = _shards(store)
    assert stats["aux_layer_ids"] == default_aux_layer_ids(6) == m.stats["aux_layer_ids"]
    assert stats["tokens"] == sum(len(s[1]) for s in samples) == sum(s.num_tokens for s in shards)
    assert 0 <= stats["padding_ratio"] < 0.5 and stats["tokens_per_s"] > 0
    assert stats["hidden_bytes_per_token"] == (4 * 64 * 2 if storage == "bfloat16" else 4 * 64 + 16)
    assert len(shards) > 1
    ids = [int(i) for s in shards for i in s.sample_ids]
    assert ids == [s[0] for s in samples]  # every sample once, in order
    for s in shards:
        assert s.storage_dtype == storage and s.validate(64) == []
        assert s.aux_hidden.shape == (s.num_tokens, 192) and s.final_hidden.shape == (s.num_tokens, 64)
    index = json.loads(store.get_bytes(key_of(store, 't', "extract", f"{INDEX}")))
    assert index["num_samples"] == 12 and index["hidden_size"] == 64 and index["num_layers"] == 6
    assert index["aux_layer_ids"] == m.stats["aux_layer_ids"] and index["storage_dtype"] == storage
    from safetensors.torch import load_file

    head = load_file(str(store.local_path(key_of(store, 't', "extract", f"{TARGET_HEAD}"))))
    assert head["embed_tokens.weight"].shape == head["lm_head.weight"].shape == (index["target_vocab_size"], 64)
    assert verify_stage(store, "t", "extract", deep=True, content_check=extract_stage.deep_check).complete


def test_extracted_states_match_the_target(tmp_path, tiny_target_dir, tiny_target_dirs):
    """Shard rows equal HF hidden_states[k] / [-1] of each sample run alone."""
    from transformers import AutoModelForCausalLM

    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("llama"), **{
        "extract.shard_tokens": 50, "extract.batch_tokens": 80, "extract.storage_dtype": "float32"})
    samples = random_samples(5, seed=3)
    commit_generate(cfg, samples, tmp_path)
    run_stage(cfg, "extract")
    _, shards = _shards(open_store(cfg.store.uri))
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dirs["llama"], dtype=torch.float32).eval()
    aux_ids = default_aux_layer_ids(6)
    rows = {int(sid): (s, i) for s in shards for i, sid in enumerate(s.sample_ids)}
    for sid, ids, _ in samples:
        shard, i = rows[sid]
        with torch.inference_mode():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        span = shard.sample(i)
        want_aux = torch.cat([hs[k][0] for k in aux_ids], dim=-1)
        torch.testing.assert_close(shard.aux_hidden_float()[span], want_aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(shard.final_hidden_float()[span], hs[-1][0], rtol=1e-4, atol=1e-4)
        assert shard.input_ids[span].tolist() == ids


class Killed(Exception):
    """Simulates the job being killed in the middle of extraction."""


def _killed_at_the_third_shard(tmp_path, tiny_target_dir, monkeypatch):
    """(config of a run whose extract was killed after two shards, its samples, a clean run's manifest)."""
    overrides = {"extract.shard_tokens": 60, "extract.batch_tokens": 64}
    samples = random_samples(10, seed=1)
    clean = pipeline_config(tmp_path / "clean", tiny_target_dir("llama"), **overrides)
    commit_generate(clean, samples, tmp_path)
    run_stage(clean, "extract")
    clean_m, _ = _shards(open_store(clean.store.uri))

    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("llama"), **overrides)
    commit_generate(cfg, samples, tmp_path)
    real_extract, calls = extract_stage.extract_shard, []

    def dies_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Killed()
        return real_extract(*args, **kwargs)

    monkeypatch.setattr(extract_stage, "extract_shard", dies_on_third)
    with pytest.raises(Killed):
        run_stage(cfg, "extract")
    assert not verify_stage(open_store(cfg.store.uri), "t", "extract").complete
    monkeypatch.setattr(extract_stage, "extract_shard", real_extract)
    return cfg, samples, clean_m


def _same_shards_as(clean_m, store, samples) -> None:
    m, shards = _shards(store)
    ids = [int(i) for s in shards for i in s.sample_ids]
    assert ids == [s[0] for s in samples]
    # Same shards, byte for byte, as a run that was never interrupted.
    assert {o.key: o.sha256 for o in m.objects if o.key.startswith("shards/")} == \
        {o.key: o.sha256 for o in clean_m.objects if o.key.startswith("shards/")}


def test_resume_after_kill_adopts_shards_without_duplicates(tmp_path, tiny_target_dir, monkeypatch):
    cfg, samples, clean_m = _killed_at_the_third_shard(tmp_path, tiny_target_dir, monkeypatch)
    stats = run_stage(cfg, "extract")
    assert stats["shards_adopted"] == 2
    _same_shards_as(clean_m, open_store(cfg.store.uri), samples)


def test_a_shard_edited_in_place_before_resume_is_extracted_again(tmp_path, tiny_target_dir, monkeypatch, capfd):
    cfg, samples, clean_m = _killed_at_the_third_shard(tmp_path, tiny_target_dir, monkeypatch)
    store = open_store(cfg.store.uri)
    shard = "shards/shard-000001.safetensors"
    path = store.local_path(attempt_key(store, "t", "extract", shard))
    flip_in_place(path, keep_mtime=True)  # same size, same mtime: only its content (and ctime) moved
    capfd.readouterr()
    stats = run_stage(cfg, "extract")
    assert stats["shards_adopted"] == 1
    said = [ln for ln in capfd.readouterr().err.splitlines() if "discarded" in ln]
    assert len(said) == 1 and said[0].startswith(f"extract: discarded {shard} of the interrupted attempt (corrupted")
    _same_shards_as(clean_m, store, samples)
    assert verify_stage(store, "t", "extract", deep=True, content_check=extract_stage.deep_check).complete


def test_bad_aux_ids_are_one_line_errors(tmp_path, tiny_target_dir):
    from eagle3.errors import StageError

    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("llama"), **{"target.aux_layer_ids": [1, 3, 9]})
    commit_generate(cfg, random_samples(2), tmp_path)
    with pytest.raises(StageError, match=r"target.aux_layer_ids: aux layer ids \[9\] out of range"):
        run_stage(cfg, "extract")


@pytest.mark.slow
def test_torchrun_two_processes_split_the_shards(tmp_path, tiny_target_dir):
    """Two CPU ranks (gloo) extract the shards between them; the committed stage equals one process's."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.fixtures_targets import free_port

    opts = {"extract.shard_tokens": 100, "extract.batch_tokens": 64}
    samples = random_samples(12)
    one = pipeline_config(tmp_path / "one", tiny_target_dir("llama"), **opts)
    two = pipeline_config(tmp_path / "two", tiny_target_dir("llama"), **opts)
    for cfg, scratch in ((one, tmp_path / "g1"), (two, tmp_path / "g2")):
        scratch.mkdir()
        commit_generate(cfg, samples, scratch)
    run_stage(one, "extract")
    conf = tmp_path / "two.yaml"
    conf.write_text(yaml.safe_dump(json.loads(two.model_dump_json())))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "eagle3.cli.stage", "stage", "extract", "--config", str(conf)]
    run = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    totals = [json.loads(line.split(" ", 1)[1])["total"] for line in run.stderr.splitlines() if line.startswith("EAGLE3_PROGRESS")]
    all_tokens = sum(len(s[1]) for s in samples)
    assert totals and max(totals) < all_tokens  # each rank reported only its own share
    (m1, shards1), (m2, shards2) = _shards(open_store(one.store.uri)), _shards(open_store(two.store.uri))
    assert m2.stats["processes"] == 2 and m2.stats["tokens_extracted"] == all_tokens == m1.stats["tokens_extracted"]
    assert m1.keys() == m2.keys() and len(shards2) >= 2
    for a, b in zip(shards1, shards2):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sample_ids, b.sample_ids)
        torch.testing.assert_close(a.aux_hidden, b.aux_hidden)
        torch.testing.assert_close(a.final_hidden, b.final_hidden)
    store = open_store(two.store.uri)
    assert verify_stage(store, "t", "extract", deep=True, content_check=extract_stage.deep_check).complete
