"""The train stage on real upstream stages: fabricated generate, real vocab, real extract of tiny-llama."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from transformers import AutoConfig

from eagle3.context import run_stage
from eagle3.drafter.adapter import load_drafter
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.errors import StageError
from eagle3.manifest import read_manifest, verify_stage
from eagle3.store import open_store
from eagle3.targets.tiny import builtin_target_dir
from eagle3.train import stage as train_stage
from eagle3.train.checkpoint import CheckpointRef, drafter_weights, run_checkpoints
from eagle3.train.loop import StopFlag
from eagle3.train.metrics import parse_metrics
from eagle3.train.optim import muon_matrix
from eagle3.config import PipelineConfig, load_config
from tests.extract.pipeline import commit_generate, random_samples
from tests.fixtures_targets import free_port
from tests.committed import attempt_key, flip_in_place, key_of

TRAIN = {
    "train.max_steps": 6, "train.batch_tokens": 160, "train.max_seq_len": 48, "train.log_every": 1,
    "train.checkpoint_every": 2, "train.warmup_steps": 2, "train.eval_fraction": 0.1, "train.ttt_steps": 3,
    "train.device": "cpu", "train.lr": 1e-3,
}
UPSTREAM = {"vocab.draft_vocab_size": 64, "extract.shard_tokens": 400, "extract.device": "cpu"}


def pipeline_config(store_dir: Path, cache_dir: Path, **overrides) -> PipelineConfig:
    base = {"store.uri": f"file://{store_dir}", "run_id": "t", "target.model": str(builtin_target_dir("llama", cache_dir))}
    return load_config(None, {**base, **overrides})


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, tiny_llama_cache_dir) -> tuple[Path, Path]:
    """(store dir with generate, vocab, extract committed; target cache dir)."""
    root = tmp_path_factory.mktemp("train-upstream")
    cfg = pipeline_config(root / "store", tiny_llama_cache_dir, **UPSTREAM)
    samples = random_samples(40, lo=8, hi=40)
    vocab = AutoConfig.from_pretrained(builtin_target_dir("llama", tiny_llama_cache_dir)).vocab_size
    counts = torch.zeros(vocab, dtype=torch.int64)
    for _, ids, mask in samples:
        counts += torch.bincount(torch.tensor(ids)[torch.tensor(mask).bool()], minlength=vocab)
    commit_generate(cfg, samples, root, extra={"token_freq.safetensors": save_safetensors({"counts": counts})})
    run_stage(cfg, "vocab")
    run_stage(cfg, "extract")
    return root / "store", tiny_llama_cache_dir


def fresh_config(upstream, tmp_path, **extra):
    store_dir, cache = upstream
    shutil.copytree(store_dir, tmp_path / "store")
    return pipeline_config(tmp_path / "store", cache, **{**UPSTREAM, **TRAIN, **extra})


def test_train_commits_drafter_metrics_and_last_two_checkpoints(upstream, tmp_path):
    cfg = fresh_config(upstream, tmp_path)
    stats = run_stage(cfg, "train")
    assert stats["steps"] == 6 and stats["world_size"] == 1 and stats["tokens"] > 0
    assert {f"final_acc_{k}" for k in range(3)} <= set(stats) and "eval_loss_0" in stats
    assert {"eval_chain_acc_0", "eval_chain_acc_2", "eval_same_as_step0_1"} <= set(stats)
    assert stats["eval_chain_acc_0"] == pytest.approx(stats["eval_acc_0"])  # step 0 has no step before it
    store = open_store(cfg.store.uri)
    m = read_manifest(store, "t", "train").manifest
    keys = m.keys()
    assert {"drafter.safetensors", "drafter_config.json", "metrics.jsonl", "loss.png"} <= set(keys)
    assert any(k.startswith("tensorboard/") for k in keys)
    assert sorted({k.split("/")[1] for k in m.keys("checkpoints/")}) == ["step-0000004", "step-0000006"]
    assert not store.exists(key_of(store, 't', "train", 'checkpoints/step-0000002/state.json'))
    assert [c.step for c in run_checkpoints(store, "t")] == [4, 6]
    last = load_file(store.local_path(run_checkpoints(store, "t")[-1].prefix + "/model.safetensors"))
    final = load_file(store.local_path(key_of(store, 't', "train", 'drafter.safetensors')))
    assert sorted(drafter_weights(last)) == sorted(final)
    for k, v in drafter_weights(last).items():
        torch.testing.assert_close(v, final[k])
    assert verify_stage(store, "t", "train", deep=True, content_check=train_stage.deep_check).complete
    records = parse_metrics(store.get_bytes(key_of(store, 't', "train", 'metrics.jsonl')).decode())
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "loss_2", "acc_2", "data_wait_frac"} <= set(records[0])
    assert all(0 <= r["data_wait_frac"] <= 1 for r in records)
    head = load_file(store.local_path(key_of(store, 't', "extract", 'target_head.safetensors')))
    drafter = load_drafter(store.local_path(key_of(store, 't', "train", 'drafter.safetensors')), head["embed_tokens.weight"])
    assert drafter.config.draft_vocab_size == 64 and drafter.config.aux_layer_ids == stats["aux_layer_ids"]


def test_last_step_is_logged_when_the_data_ends_between_log_boundaries(upstream, tmp_path):
    # One epoch ends long before max_steps; with log_every larger than the steps run, the
    # last step must still be recorded (deep_check rejects a train stage with no metrics).
    cfg = fresh_config(upstream, tmp_path, **{"train.max_steps": 10_000, "train.log_every": 1000, "train.epochs": 1.0})
    stats = run_stage(cfg, "train")
    store = open_store(cfg.store.uri)
    records = parse_metrics(store.get_bytes(key_of(store, 't', "train", 'metrics.jsonl')).decode())
    assert [r["step"] for r in records] == [stats["steps"]]
    assert verify_stage(store, "t", "train", deep=True, content_check=train_stage.deep_check).complete


def test_profiled_steps_leave_a_summary_tables_and_a_trace_in_the_stage_output(upstream, tmp_path, capfd):
    cfg = fresh_config(upstream, tmp_path, **{"train.profile_steps": "2:4"})
    stats = run_stage(cfg, "train")
    prof = stats["profile"]
    assert prof["steps"] == [2, 4] and prof["wall_ms_per_step"] > 0 and prof["data_wait_ms_per_step"] >= 0
    assert prof["device_busy_ms_per_step"] is None  # on the CPU there is no device timeline
    store = open_store(cfg.store.uri)
    keys = set(read_manifest(store, "t", "train").manifest.keys("profile/"))
    assert keys == {"profile/summary.json", "profile/host_ops.txt", "profile/trace.json.gz"}
    summary = json.loads(store.get_bytes(key_of(store, 't', "train", 'profile/summary.json')))
    assert summary["top_host_ops"] and summary["top_host_ops"][0]["ms_per_step"] > 0
    trace = json.loads(gzip.decompress(store.get_bytes(key_of(store, 't', "train", 'profile/trace.json.gz'))))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert "train: profiled steps 2..3:" in capfd.readouterr().err


def test_profiling_stops_where_the_data_ends(upstream, tmp_path):
    cfg = fresh_config(upstream, tmp_path, **{"train.max_steps": 10_000, "train.epochs": 1.0, "train.profile_steps": "1:9999"})
    stats = run_stage(cfg, "train")
    assert stats["profile"]["steps"] == [1, stats["steps"]]


@pytest.mark.parametrize("spec", ["5:5", "9:2", "a:b", "3"])
def test_a_profile_range_that_is_not_a_to_b_is_rejected_at_config_load(spec):
    with pytest.raises(Exception, match="profile_steps"):
        load_config(None, {"train.profile_steps": spec})


def test_loss_tokens_all_teaches_the_prompts_positions_and_holds_out_the_responses_alone(upstream, tmp_path):
    # The same batches in the same order under either setting; with "all" every step teaches more positions (the
    # samples' first third is prompt), and the held-out metrics are measured on the response's tokens as before.
    runs = {}
    for which in ("assistant", "all"):
        cfg = fresh_config(upstream, tmp_path / which, **{"train.loss_tokens": which})
        stats = run_stage(cfg, "train")
        store = open_store(cfg.store.uri)
        runs[which] = stats, parse_metrics(store.get_bytes(key_of(store, "t", "train", "metrics.jsonl")).decode())
    (own, own_log), (every, every_log) = runs["assistant"], runs["all"]
    assert own["tokens"] == every["tokens"] and [r["tokens"] for r in own_log] == [r["tokens"] for r in every_log]
    assert all(e["taught_tokens"] > 1.3 * o["taught_tokens"] > 0 for o, e in zip(own_log, every_log, strict=True))
    assert own_log[0]["loss"] != every_log[0]["loss"]  # the first step's loss already covers other positions
    assert {k for k in own if k.startswith("eval_")} == {k for k in every if k.startswith("eval_")}
    with pytest.raises(Exception, match="loss_tokens"):
        load_config(None, {"train.loss_tokens": "prompt"})


class StopAtCall(StopFlag):
    """Test double for the SIGTERM flag: reports a stop request on its n-th check."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n

    def install(self) -> StopAtCall:
        return self


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_stop_then_rerun_continues_the_same_loss_trajectory(upstream, tmp_path, monkeypatch, optimizer):
    # Muon's momentum and AdamW's moments (the head, the norms) both come back from the checkpoint,
    # or the resumed steps would drift from the whole run's.
    whole = run_stage(fresh_config(upstream, tmp_path / "a", **{"train.optimizer": optimizer}), "train")
    assert whole is not None
    cfg = fresh_config(upstream, tmp_path / "b", **{"train.optimizer": optimizer})
    monkeypatch.setattr(train_stage, "StopFlag", lambda: StopAtCall(4))  # stop before the 4th step
    with pytest.raises(StageError, match="stopped on request at step 3"):
        run_stage(cfg, "train")
    store = open_store(cfg.store.uri)
    assert read_manifest(store, "t", "train") is None
    assert store.exists(attempt_key(store, 't', "train", 'checkpoints/step-0000003/state.json'))
    assert run_checkpoints(store, "t")[-1] == CheckpointRef(3, attempt_key(store, 't', "train", 'checkpoints/step-0000003'))
    monkeypatch.undo()
    resumed = run_stage(cfg, "train")
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == 6
    a = parse_metrics(open_store(f"file://{tmp_path / 'a' / 'store'}").get_bytes(key_of(open_store(f"file://{tmp_path / 'a' / 'store'}"), 't', "train", 'metrics.jsonl')).decode())
    b = parse_metrics(store.get_bytes(key_of(store, 't', "train", 'metrics.jsonl')).decode())
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        for k in ("loss", "loss_0", "loss_2", "acc_1", "grad_norm", "lr"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-7), (ra["step"], k)


def test_a_checkpoint_edited_in_place_before_resume_is_discarded_for_the_one_before(
        upstream, tmp_path, monkeypatch, capfd):
    whole = run_stage(fresh_config(upstream, tmp_path / "a"), "train")
    assert whole is not None
    cfg = fresh_config(upstream, tmp_path / "b")
    monkeypatch.setattr(train_stage, "StopFlag", lambda: StopAtCall(4))  # checkpoints at steps 2 and 3
    with pytest.raises(StageError, match="stopped on request at step 3"):
        run_stage(cfg, "train")
    monkeypatch.undo()
    store = open_store(cfg.store.uri)
    weights = "checkpoints/step-0000003/model.safetensors"
    path = store.local_path(attempt_key(store, "t", "train", weights))
    flip_in_place(path, offset=path.stat().st_size - 1)  # the last byte: a weight, not the header
    capfd.readouterr()
    resumed = run_stage(cfg, "train")
    said = [ln for ln in capfd.readouterr().err.splitlines() if "discarded" in ln]
    assert len(said) == 1 and said[0].startswith(f"train: discarded {weights} of the interrupted attempt (corrupted")
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 6
    a_store = open_store(f"file://{tmp_path / 'a' / 'store'}")
    a = parse_metrics(a_store.get_bytes(key_of(a_store, "t", "train", "metrics.jsonl")).decode())
    b = parse_metrics(store.get_bytes(key_of(store, "t", "train", "metrics.jsonl")).decode())
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):  # steps 3..6 trained again from step 2's checkpoint, as the whole run did
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7), ra["step"]
    assert verify_stage(store, "t", "train", deep=True, content_check=train_stage.deep_check).complete


def test_sigterm_sets_the_stop_flag():
    flag = StopFlag().install()
    try:
        assert not flag()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag()
    finally:
        flag.restore()


def torchrun_train(cfg: PipelineConfig, tmp_path: Path) -> None:
    """The train stage in two CPU processes over gloo, as a pod's torchrun runs it."""
    conf = tmp_path / "cfg.yaml"
    conf.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EAGLE3_DEBUG": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "eagle3.cli.stage", "stage", "train", "--config", str(conf)]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    assert rc == 0, log.read_text()[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "optimizer"), [("ddp", "adamw"), ("fsdp", "adamw"), ("ddp", "muon")])
def test_torchrun_two_cpu_processes_over_gloo(upstream, tmp_path, strategy, optimizer):
    cfg = fresh_config(upstream, tmp_path, **{"train.max_steps": 2, "train.checkpoint_every": 2, "train.strategy": strategy,
                                              "train.optimizer": optimizer})
    torchrun_train(cfg, tmp_path)
    store = open_store(cfg.store.uri)
    m = read_manifest(store, "t", "train").manifest
    assert m.stats["world_size"] == 2 and m.stats["steps"] == 2 and m.stats["strategy"] == strategy
    assert sorted({k.split("/")[1] for k in m.keys("checkpoints/")}) == ["step-0000002"]
    assert verify_stage(store, "t", "train", deep=True, content_check=train_stage.deep_check).complete
    torch.testing.assert_close(load_file(store.local_path(key_of(store, 't', "train", 'drafter.safetensors')))["fc.weight"].sum(),
                               load_file(store.local_path(key_of(store, 't', "train", 'checkpoints/step-0000002/model.safetensors')))["drafter.fc.weight"].sum())


@pytest.mark.slow
def test_muon_on_fsdp_shards_orthogonalizes_whole_matrices(upstream, tmp_path):
    # Muon orthogonalizes each whole weight matrix; under FSDP every rank holds a row shard (a DTensor).
    # Orthogonalizing each shard alone would step the weights elsewhere than DDP (whole matrices on every
    # rank). The same math in bf16 in another order differs too: Newton-Schulz blows up the small singular
    # directions of these low-rank first gradients, up to ~11 % of the step here.
    trained, config, seed = {}, None, None
    for strategy in ("ddp", "fsdp"):
        cfg = fresh_config(upstream, tmp_path / strategy, **{"train.max_steps": 2, "train.checkpoint_every": 2,
                                                              "train.strategy": strategy, "train.optimizer": "muon"})
        torchrun_train(cfg, tmp_path / strategy)
        seed = cfg.train.seed
        store = open_store(cfg.store.uri)
        trained[strategy] = load_file(store.local_path(key_of(store, 't', "train", 'drafter.safetensors')))
        config = json.loads(store.get_bytes(key_of(store, 't', "train", 'drafter_config.json')))
    torch.manual_seed(seed)  # the initial weights, as the stage builds them
    initial = Eagle3Drafter(DrafterConfig.from_dict(config)).state_dict()
    matrices = [n for n, w in trained["ddp"].items() if muon_matrix(n, w) and n in initial]
    assert "fc.weight" in matrices and len(matrices) >= 8
    for name in matrices:
        ddp, fsdp = (trained[s][name].float() - initial[name].float() for s in ("ddp", "fsdp"))
        assert ddp.norm() > 0
        assert ddp.norm() < 0.05 * initial[name].norm()  # two small steps from these initial weights
        assert (fsdp - ddp).norm() / ddp.norm() < 0.25, name


def test_a_stalled_chain_is_named_in_one_line():
    from eagle3.train.stage import chain_stalled

    stalled = {"eval_same_as_step0_1": 0.82, "eval_chain_acc_1": 0.04, "eval_acc_1": 0.23}  # a drafter whose chain does not advance
    line = chain_stalled(stalled)
    assert line is not None and "\n" not in line and "82%" in line
    assert chain_stalled({"eval_same_as_step0_1": 0.05, "eval_chain_acc_1": 0.89, "eval_acc_1": 0.78}) is None  # tiny chain
    assert chain_stalled({}) is None  # no held-out samples
