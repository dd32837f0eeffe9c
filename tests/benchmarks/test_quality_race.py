"""The quality race's plumbing (benchmarks/quality/): which steps run, and the checkpoint snapshots."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3.manifest import StageOutput
from eagle3.store import open_store
from eagle3.train.checkpoint import FILES, step_dir
from eagle3.settings.train import TrainSettings
from tests.benchmarks.quality_modules import load

run_quality, curve, summarize = load("run_quality"), load("curve"), load("summarize")
REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path, **flags):
    """A race's Bench over ``tmp_path`` with the race's flags (their defaults as run_quality parses them, so ours'
    follow the train stage's), ``flags`` changed (nothing runs)."""
    a = run_quality.parse_args(["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--budget-s", "60",
                                "--tiny", "--sides", "ours,spec,specce", "--draft-vocabs", "32768", "--train-steps", "1000"])
    vars(a).update(flags)
    return run_quality.Bench(a)


def test_steps_interleave_the_vocabs_and_expand_the_side_names():
    every = run_quality.race_steps([16384, 64000])
    assert every == ["target", "spec_warm", "prep", "spec_data", "ours_v16384", "spec_v16384", "ours_v64000",
                     "spec_v64000", "curve", "plot"]
    assert run_quality.select_steps("all", [16384, 64000]) == every
    assert run_quality.select_steps("plot,spec,prep", [16384, 64000]) == ["prep", "spec_v16384", "spec_v64000", "plot"]
    with pytest.raises(SystemExit, match="unknown step 'train_ours'"):
        run_quality.select_steps("train_ours", [16384])
    three = ("ours", "spec", "specce")  # --sides: speculators with its ce loss as a further side
    assert run_quality.race_steps([32768], three)[4:7] == ["ours_v32768", "spec_v32768", "specce_v32768"]
    assert run_quality.select_steps("spec", [32768], three) == ["spec_v32768"]  # not specce's step too
    assert run_quality.select_steps("specce,curve", [32768], three) == ["specce_v32768", "curve"]
    with pytest.raises(SystemExit, match="unknown step 'specce_v32768'"):
        run_quality.select_steps("specce_v32768", [32768])  # not a side of this race
    assert [run_quality.side_and_vocab(s) for s in ("specce_v32768", "ours_v64000", "spec_data", "plot")] == [
        ("specce", 32768), ("ours", 64000), None, None]


def _checkpoint(out: StageOutput, step: int, files=FILES) -> None:
    for name in files:
        out.put_bytes(f"{step_dir(step)}/{name}", b"w" * step if name == "model.safetensors" else b'{"step": %d}' % step)


def test_snapshots_keep_every_checkpoint_the_trainer_prunes(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    train = StageOutput(store, "q-v512", "train", "0123456789ab" * 5 + "0123", {})
    train.begin()  # a training in progress: its checkpoints are in its attempt folder
    dest = tmp_path / "snapshots"
    snaps = curve.Snapshots(lambda: curve.our_checkpoints(store, "q-v512"), dest, every_s=3600)
    _checkpoint(train, 4)
    snaps.poll()
    _checkpoint(train, 8)
    train.drop(f"{step_dir(4)}/state.json")  # pruned by the trainer (KEEP newest)
    _checkpoint(train, 12, files=FILES[:2])  # being written: no state.json yet, not copied
    snaps.poll()
    assert [s for s, _ in curve.snapshot_steps(dest)] == [4, 8]
    assert (dest / "step-0000008" / "model.safetensors").read_bytes() == b"w" * 8
    assert json.loads((dest / "step-0000004" / "state.json").read_text()) == {"step": 4}


def test_a_retraining_snapshots_its_own_checkpoints_not_the_committed_ones_it_replaces(tmp_path):
    """What made a device run report the old drafter as the new one: until the retraining's attempt folder
    appears, run_checkpoints lists the committed training's checkpoints, and a step once snapshotted is never
    taken again. Those of the committed output the retraining replaces are not listed."""
    store = open_store(f"file://{tmp_path / 'store'}")
    old = StageOutput(store, "q-v512", "train", "a" * 64, {})
    old.begin()
    for step in (8, 12):
        _checkpoint(old, step)
    old.commit({})
    unfiltered = tmp_path / "unfiltered"  # the bug: the pipeline starting, the old step 12 is taken
    curve.Snapshots(lambda: curve.our_checkpoints(store, "q-v512"), unfiltered, every_s=3600).poll()
    assert (unfiltered / "step-0000012" / "model.safetensors").read_bytes() == b"w" * 12
    dest = tmp_path / "snapshots"
    snaps = curve.Snapshots(lambda: curve.our_checkpoints(store, "q-v512", not_under=old.prefix), dest, every_s=3600)
    snaps.poll()
    assert curve.snapshot_steps(dest) == []
    new = StageOutput(store, "q-v512", "train", "b" * 64, {})
    new.begin()
    new.put_bytes(f"{step_dir(12)}/model.safetensors", b"new")
    for name in FILES[1:]:
        new.put_bytes(f"{step_dir(12)}/{name}", b"{}")
    snaps.poll()
    assert [(s, (p / "model.safetensors").read_bytes()) for s, p in curve.snapshot_steps(dest)] == [(12, b"new")]


def test_a_retraining_of_another_recipe_starts_from_nothing_the_old_one_left(tmp_path):
    """Removing a result to retrain with other flags: the old training's snapshots and curve points (a point
    already there is not evaluated again) and speculators' checkpoints (it would resume from the last one
    and stop at once) go; a training cut mid-way and resumed with the same recipe keeps all of them."""
    def leave(b, side):
        paths = [b.snapshots(side, 32768) / "step-0001000", b.point_file(32768, side, 1000).parent]
        if side != "ours":
            paths.append(b.work / f"{side}_ckpt_v32768" / "3")
        for p in paths:
            p.mkdir(parents=True, exist_ok=True)
            (p / "model.safetensors").write_bytes(b"old")
        return paths

    first, left = _bench(tmp_path, teacher_temperature=0.25), {}
    for side in ("ours", "specce"):
        first.begin_training(side, 32768)
        left[side] = leave(first, side)
        first.begin_training(side, 32768)  # resumed: same recipe
        assert all(p.exists() for p in left[side])
    later = _bench(tmp_path, teacher_temperature=0.1, ttt_decay=0.6)
    later.begin_training("ours", 32768)
    assert [p.exists() for p in left["ours"] + left["specce"]] == [False, False, True, True, True]  # one side's
    later.begin_training("specce", 32768)
    assert not any(p.exists() for p in left["specce"])
    assert json.loads((later.work / "recipes" / "ours-v32768.json").read_text())["teacher_temperature"] == 0.1


def test_speculators_checkpoints_are_named_by_their_global_step(tmp_path):
    save = tmp_path / "spec_ckpt"
    (save / "0").mkdir(parents=True)
    (save / "0" / "model.safetensors").write_bytes(b"x")
    (save / "0" / "training_state.json").write_text(json.dumps({"epoch": 0, "local_step": 100, "global_step": 100}))
    (save / "1").mkdir()
    (save / "1" / "training_state.json").write_text("{not json")  # being rewritten: skipped this poll
    assert curve.spec_checkpoints(save) == [(100, save / "0")]
    dry = tmp_path / "dry"
    dry.mkdir()
    (dry / "model.safetensors").write_bytes(b"x")  # --dry-run: the initialized drafter in save/ itself
    assert curve.spec_checkpoints(dry) == [(0, dry)]


@pytest.mark.parametrize("draft_vocab", [256, None])  # None: the target's whole vocab, no mapping kept
def test_a_speculators_checkpoint_exports_as_the_export_stage_writes(tmp_path, tiny_llama_dir, draft_vocab):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from eagle3.drafter.adapter import expected_shapes
    from eagle3.drafter.model import DrafterConfig
    from eagle3.export.stage import check_export, tensor_meta
    from eagle3.export.vllm_config import build_vllm_config
    from eagle3.vocab.mapping import build_vocab_mapping

    vocab, hidden = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size, 64
    dcfg = DrafterConfig(hidden_size=hidden, target_hidden_size=hidden, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=vocab, draft_vocab_size=draft_vocab or vocab,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, aux_layer_ids=[1, 3, 4])
    torch.manual_seed(0)
    ours = {k: torch.randn(shape) for k, shape in expected_shapes(dcfg).items()}
    theirs = {k.replace("midlayer.", "layers.0."): v for k, v in ours.items()} | {"embed_tokens.weight": torch.zeros(1)}
    if draft_vocab:
        d2t, t2d = build_vocab_mapping(torch.arange(vocab, 0, -1), draft_vocab)
        theirs |= {"d2t": d2t, "t2d": t2d}
    ckpt = tmp_path / "spec" / "0"
    ckpt.mkdir(parents=True)
    save_file(theirs, str(ckpt / "model.safetensors"))
    layer = {k: getattr(dcfg, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")}
    (ckpt / "config.json").write_text(json.dumps({"transformer_layer_config": {**layer, "rope_theta": 10000.0}}))
    out = tmp_path / "export"
    result = load("spec_train").export_ours(ckpt, str(tiny_llama_dir), [1, 3, 4], out)
    assert result["ignored_tensors"] == ["embed_tokens.weight"]
    config = json.loads((out / "config.json").read_text())
    assert config == build_vllm_config(dcfg, [1, 3, 4])
    assert check_export(config, tensor_meta(out / "model.safetensors"), [1, 3, 4]) == []
    exported = load_file(str(out / "model.safetensors"))
    for k, v in ours.items():
        assert torch.equal(exported[k], v.to(torch.bfloat16)), k
    if not draft_vocab:  # a full draft vocab is exported without a mapping (vLLM 0.30+ refuses one)
        assert "d2t" not in exported and "t2d" not in exported


def test_a_speculators_training_cut_by_a_deadline_reports_both_parts():
    """Call 2's part (cut at step 761) and call 3's resumed part: the wall adds up, the peak is the higher,
    tokens/s is weighted by logged steps; a fresh start (no earlier part) stays as measured."""
    merge = load("spec_train").merge_parts
    cut = {"wall_seconds": 223.3, "peak_memory_gib": 25.926, "steady_tokens_per_s": 81366.6, "logged_steps": 153,
           "last_step": 761}
    first = merge(None, {**cut, "argv": ["--max-steps", "1000"]})
    assert first["wall_seconds"] == 223.3 and first["steady_tokens_per_s"] == 81366.6 and len(first["parts"]) == 1
    resumed = {"wall_seconds": 123.6, "peak_memory_gib": 25.923, "steady_tokens_per_s": 81714.9, "logged_steps": 49,
               "last_step": 1001, "final_train_metrics": {"loss": 1.34}}
    both = merge(first, resumed)
    assert both["wall_seconds"] == 346.9 and both["peak_memory_gib"] == 25.926 and both["last_step"] == 1001
    assert both["steady_tokens_per_s"] == round((81366.6 * 153 + 81714.9 * 49) / 202, 1)
    assert [p["last_step"] for p in both["parts"]] == [761, 1001] and both["final_train_metrics"] == {"loss": 1.34}
    assert merge(cut, resumed)["wall_seconds"] == 346.9  # an earlier part written without "parts" is one part
    unrated = merge(None, {**resumed, "steady_tokens_per_s": None, "peak_memory_gib": None})  # a CPU --dry-run
    assert unrated["steady_tokens_per_s"] is None and unrated["peak_memory_gib"] is None


def test_a_saved_training_of_another_recipe_is_named_not_taken(tmp_path):
    """A call with other recipe flags must not report a training saved under the old ones as its own: run()
    names the difference. A result saved before a setting was kept counts as that setting's default."""
    b = _bench(tmp_path, teacher_temperature=0.25)
    b.save("ours_v32768", {"final_step": 1000, **b.recipe("ours")})
    b.save("specce_v32768", {"final_step": 1000, **b.recipe("specce")})
    b.save("spec_v32768", {"final_step": 1000, "train_steps": 1000})  # saved before the recipe was kept
    assert b.recipe("specce") == {"train_steps": 1000, "ttt_decay": 0.8, "optimizer": "adamw", "lr": 5e-4, "loss_fn": "ce"}
    assert [b.recipe_change(s) for s in ("ours_v32768", "spec_v32768", "specce_v32768", "plot")] == [None] * 4
    later = _bench(tmp_path, teacher_temperature=0.1, ttt_decay=0.6)
    assert later.recipe_change("ours_v32768") == "ttt_decay 0.8 (now 0.6), teacher_temperature 0.25 (now 0.1)"
    assert later.recipe_change("spec_v32768") == "ttt_decay 0.8 (now 0.6)"  # both systems get the decay
    assert _bench(tmp_path, train_steps=1200).recipe_change("specce_v32768") == "train_steps 1000 (now 1200)"
    # the optimizer and its peak lr go to both systems: a result saved before they were kept was AdamW at 5e-4
    assert _bench(tmp_path, optimizer="muon", lr=2e-3).recipe_change("spec_v32768") == "optimizer adamw (now muon), lr 0.0005 (now 0.002)"
    # ours' head and schedule end are ours alone: a training saved before they were kept had the train stage's
    # defaults (head trained, cosine to 0.1 lr); speculators' result does not change with them
    b.save("ours_v32768", {"final_step": 1000, "train_steps": 1000, "teacher_temperature": 0.25})
    frozen = _bench(tmp_path, teacher_temperature=0.25, lm_head="target-frozen", min_lr_ratio=0.0, adamw_lr=5e-4)
    assert frozen.recipe_change("ours_v32768") == ("lm_head target (now target-frozen), min_lr_ratio 0.1 (now 0.0), "
                                                   "adamw_lr None (now 0.0005)")
    assert frozen.recipe_change("spec_v32768") is None
    # the regularisers too: a training saved before them had no feature noise and Muon's decay 0.1
    noised = _bench(tmp_path, teacher_temperature=0.25, feature_noise=0.1, muon_weight_decay=0.3)
    assert noised.recipe_change("ours_v32768") == "feature_noise 0.0 (now 0.1), muon_weight_decay 0.1 (now 0.3)"
    assert noised.recipe_change("spec_v32768") is None
    # another seed is another training of the same recipe (the spread of one), never taken for seed 0's
    assert _bench(tmp_path, teacher_temperature=0.25, seed=1).recipe_change("ours_v32768") == "seed 0 (now 1)"
    # the prompt's positions taught too: the same samples, another training
    assert (_bench(tmp_path, teacher_temperature=0.25, loss_tokens="all").recipe_change("ours_v32768")
            == "loss_tokens assistant (now all)")
    flags = ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--tiny", "--draft-vocabs", "512",
             "--lm-head", "target-frozen", "--min-lr-ratio", "0", "--adamw-lr", "5e-4", "--feature-noise", "0.2",
             "--muon-weight-decay", "0.3", "--seed", "2", "--loss-tokens", "all"]
    train = yaml.safe_load(run_quality.Bench(run_quality.parse_args(flags)).config(512).read_text())["train"]
    assert (train["lm_head"], train["min_lr_ratio"], train["adamw_lr"]) == ("target-frozen", 0.0, 5e-4)
    assert (train["feature_noise"], train["muon_weight_decay"], train["seed"], train["loss_tokens"]) == (0.2, 0.3, 2, "all")
    assert TrainSettings(**train).lm_head == "target-frozen"  # keys the train stage reads, not a typo it ignores


def test_ours_own_steps_are_its_recipe_so_an_equal_seconds_training_is_never_taken_for_the_races(tmp_path):
    """--ours-train-steps (a race at equal training seconds): ours trains its own steps and says so in its recipe;
    speculators keeps --train-steps. A training saved at equal seconds is named, not taken, by a later race at equal
    steps (and the other way round), and ours' points below its own last step stay on the curve."""
    b = _bench(tmp_path, ours_train_steps=3000, sides=("ours", "spec"), vocabs=[512])
    assert b.recipe("ours")["train_steps"] == 3000 and b.recipe("spec")["train_steps"] == 1000
    assert yaml.safe_load(b.config(512).read_text())["train"]["max_steps"] == 3000
    b.save("ours_v512", {"final_step": 3000, **b.recipe("ours")})
    b.save("spec_v512", {"final_step": 1001, **b.recipe("spec")})
    assert b.recipe_change("ours_v512") is None and b.recipe_change("spec_v512") is None
    equal = _bench(tmp_path, sides=("ours", "spec"), vocabs=[512])
    assert equal.recipe_change("ours_v512") == "train_steps 3000 (now 1000)"
    assert equal.recipe_change("spec_v512") is None  # speculators trained the race's steps either way
    status = equal.run(["ours_v512"])["status"]
    assert status["ours_v512"] == "done earlier with train_steps 3000 (now 1000) (--retrain trains it again)"
    for side, steps in (("ours", (1000, 2000, 3000)), ("spec", (500, 1000, 1001))):
        for step in steps:
            snap = b.snapshots(side, 512) / f"step-{step:07d}"
            snap.mkdir(parents=True)
            (snap / curve.MODEL).write_bytes(b"w")
    assert [(side, step) for _, side, step, _ in b.curve_points()] == [
        ("ours", 3000), ("spec", 1001), ("spec", 500), ("ours", 1000), ("ours", 2000)]
    with pytest.raises(SystemExit, match="--train-steps and --ours-train-steps must be at least 1"):
        run_quality.parse_args(["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--ours-train-steps", "0"])


def test_retrain_trains_a_saved_training_of_another_recipe_again_and_keeps_one_of_this_recipe(tmp_path, monkeypatch):
    """A sweep of ours' settings on one target: --retrain trains a result saved under other flags again; the
    old result stays until the new one is saved (a cut retraining loses nothing); one of this call's recipe
    (its final point cut by a deadline) is kept and not trained again."""
    trained = []

    def train(self, vocab):
        trained.append(vocab)
        return {"final_step": 1000, **self.recipe("ours")}

    monkeypatch.setattr(run_quality.Bench, "step_ours", train)
    first = _bench(tmp_path)
    first.save("prep", {"seconds": 1.0})
    first.save("ours_v32768", {"final_step": 1000, **first.recipe("ours")})
    muon = _bench(tmp_path, optimizer="muon", lr=1e-3)
    status = muon.run(["ours_v32768"])["status"]
    assert trained == [] and status["ours_v32768"].startswith("done earlier with optimizer adamw (now muon)")
    monkeypatch.setattr(run_quality.Bench, "step_ours", lambda self, v: (_ for _ in ()).throw(
        run_quality.StepFailed("deadline")))
    status = _bench(tmp_path, optimizer="muon", lr=1e-3, retrain=True).run(["ours_v32768"])["status"]
    assert "deadline" in status["ours_v32768"]
    assert muon.done("ours_v32768")["optimizer"] == "adamw"  # cut: the old result stays, named as before
    monkeypatch.setattr(run_quality.Bench, "step_ours", train)
    status = _bench(tmp_path, optimizer="muon", lr=1e-3, retrain=True).run(["ours_v32768"])["status"]
    assert trained == [32768] and muon.done("ours_v32768")["optimizer"] == "muon"
    status = _bench(tmp_path, optimizer="muon", lr=1e-3, retrain=True).run(["ours_v32768"])["status"]
    assert trained == [32768] and status["ours_v32768"] == "done earlier"


def test_a_done_marker_killed_while_written_is_the_old_one_or_the_new_one(tmp_path):
    """The race's result files decide what a later call skips: a process killed at any point of a write
    leaves a file that parses (the last whole write), never half of one; a write that fails keeps the old."""
    import os
    import signal
    import subprocess
    import sys
    import time

    files = load("files")
    path = tmp_path / "ours_v32768.json"
    files.write_json(path, {"version": 0})
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys; sys.path.insert(0, sys.argv[1]); from files import write_json; from pathlib import Path\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1; write_json(Path(sys.argv[2]), {'version': i, 'rows': list(range(200_000))})\n"),
        str(run_quality.HERE), str(path)])
    time.sleep(1.5)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert json.loads(path.read_text())["version"] >= 0  # whole: the old one or a later one

    class Unwritable:
        def __str__(self):
            raise RuntimeError("not serializable")

    files.write_json(path, {"version": "kept"})
    with pytest.raises(RuntimeError):
        files.write_json(path, {"version": Unwritable()})
    assert json.loads(path.read_text()) == {"version": "kept"}
    assert [p.name for p in tmp_path.iterdir() if p.name != path.name and not p.name.startswith(".")] == []
    assert not any(p.name.endswith(f".{os.getpid()}.tmp") for p in tmp_path.iterdir())


def test_bad_recipe_flags_are_one_line_before_anything_runs(tmp_path, capsys):
    base = ["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--tiny", "--steps", "plot"]
    for flags, said in ((["--teacher-temperature", "0"], "--teacher-temperature and --adamw-lr must be above 0"),
                        (["--ttt-decay", "1.5"], "--ttt-decay in (0, 1]"),
                        (["--min-lr-ratio", "-0.1"], "--min-lr-ratio in [0, 1]"),
                        (["--adamw-lr", "0"], "--adamw-lr must be above 0"),
                        (["--feature-noise", "-0.1"], "--feature-noise and --muon-weight-decay at least 0"),
                        (["--muon-weight-decay", "-1"], "--feature-noise and --muon-weight-decay at least 0"),
                        (["--sides", "spec,ours"], "--sides: ours first")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            run_quality.main(base + flags)
    assert not (tmp_path / "w").exists()  # refused before the work folder was made
    assert [s for s in ("spec_warm", "spec_data", "specce_v512", "spec_v512", "ours_v512", "curve")
            if run_quality.needs_speculators(s)] == ["spec_warm", "spec_data", "specce_v512", "spec_v512"]


def test_check_reads_every_flag_and_the_steps_and_runs_nothing(tmp_path):
    """--check (what a sweep asks of each setting before the first trains): flags and steps as a run reads them,
    errors in one line, no work folder made, and no torch imported (each check is a start-up on the device)."""
    base = ["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--draft-vocabs", "32768", "--check"]
    assert run_quality.main(base + ["--steps", "ours,curve", "--optimizer", "muon", "--lm-head", "target-frozen"]) == 0
    for flags, said in ((["--steps", "ours_v512"], "unknown step 'ours_v512'"),
                        (["--teacher-temp", "0.03"], "run_quality: unrecognized arguments: --teacher-temp 0.03"),
                        (["--optimizer", "sgd"], "run_quality: argument --optimizer: invalid choice: 'sgd'")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            run_quality.main(base + flags)
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()
    script = ("import sys; sys.path.insert(0, 'benchmarks/quality'); import run_quality; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    imported = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"


def test_curve_points_of_another_evaluator_are_not_mixed_in(tmp_path):
    """A call with other --eval-prompts (the next session's plan) must not pair a final point decoded on 64 prompts
    with one on 128, nor plot both on one curve: only points of this call's evaluator count, so the final drafter is
    evaluated again and intermediate points no longer evaluable drop out. A point saved before the evaluator was
    kept counts as the old defaults."""
    old = _bench(tmp_path, teacher_temperature=0.25, sides=("ours",), vocabs=[512])
    old.save("ours_v512", {"final_step": 1000, **old.recipe("ours")})
    per_prompt = [{"id": i, "mean_acceptance_length": 3.0, "verify_steps": 10} for i in range(4)]
    for step, evaluator in ((200, None), (1000, old.evaluator())):
        path = old.point_file(512, "ours", step)
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = {"step": step, "mean_acceptance_length": 3.0, "per_prompt": per_prompt}
        path.write_text(json.dumps(saved if evaluator is None else {**saved, "evaluator": evaluator}))
    assert [p["step"] for p in old.curves()[512]["eagle3ctl"]] == [200, 1000]  # no key: the old defaults
    assert old.sides()[512]["ours"]["final"]["step"] == 1000
    wider = _bench(tmp_path, teacher_temperature=0.25, sides=("ours",), vocabs=[512], eval_prompts=128)
    assert wider.point(512, "ours", 1000) is None and wider.curves() == {}
    assert wider.sides()[512]["ours"]["final"] is None  # evaluated again by the curve step, not reused
    assert wider.point_file(512, "ours", 1000).exists()  # kept: the old evaluator's point is not destroyed


def test_curve_points_carry_the_steady_training_seconds_to_their_step(tmp_path):
    """The plot's second panel: a point's x is its step times the side's steady seconds per step (its tokens over
    its steady tokens/s); a side whose training gave no rate has no seconds and stays off that panel."""
    b = _bench(tmp_path, sides=("ours", "spec"), vocabs=[512])
    b.save("ours_v512", {"final_step": 1000, "train": {"tokens": 16_000_000, "steady_tokens_per_s": 400_000.0}})
    b.save("spec_v512", {"final_step": 1000, "train": {"mean_tokens_per_step": 16_000.0}})
    per_prompt = [{"id": i, "mean_acceptance_length": 3.0, "verify_steps": 10} for i in range(4)]
    for side in ("ours", "spec"):
        for step in (500, 1000):
            path = b.point_file(512, side, step)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"step": step, "evaluator": b.evaluator(), "mean_acceptance_length": 3.0,
                                        "per_prompt": per_prompt}))
    curves = b.curves()[512]
    assert [p["seconds"] for p in curves["eagle3ctl"]] == [20.0, 40.0]
    assert [p["seconds"] for p in curves["speculators"]] == [None, None]
    b.step_plot()
    assert int.from_bytes((tmp_path / "out" / "acceptance_vs_steps.png").read_bytes()[16:20], "big") == 1440


def test_a_call_without_speculators_steps_does_not_probe_for_speculators(tmp_path, monkeypatch):
    """The probe imports speculators in a subprocess (~8 s here, more on a fresh GPU machine): a sweep call
    (ours and the curve) must not spend its budget on it; a call with a speculators step still probes."""
    probes = []
    monkeypatch.setattr(run_quality.Bench, "speculators_missing", lambda self: probes.append(1) or "skipped: test")
    bench = _bench(tmp_path)
    status = bench.run(["plot"])["status"]
    assert probes == [] and status["plot"].startswith("done")
    status = bench.run(["spec_data", "plot"])["status"]
    assert probes == [1] and status["spec_data"] == "skipped: test"


def test_a_checkpoint_at_the_last_step_is_evaluated_once(tmp_path):
    """speculators saves step 1000 at its fourth epoch's end and, one lr-0 step past --max-steps, step 1001 (the
    same weights): the curve evaluates the final one and the earlier epochs, not step 1000 a second time. Ours'
    final step is --train-steps itself and keeps every earlier point."""
    bench = _bench(tmp_path, sides=("ours", "spec"), vocabs=[512])
    for side, steps in (("ours", (200, 400, 1000)), ("spec", (253, 506, 1000, 1001))):
        bench.save(f"{side}_v512", {"final_step": steps[-1], **bench.recipe(side)})
        for step in steps:
            snap = bench.snapshots(side, 512) / f"step-{step:07d}"
            snap.mkdir(parents=True)
            (snap / curve.MODEL).write_bytes(b"w")
    assert [(side, step) for _, side, step, _ in bench.curve_points()] == [
        ("ours", 1000), ("spec", 1001), ("ours", 200), ("spec", 253), ("ours", 400), ("spec", 506)]


def test_ours_compiles_into_the_carried_inductor_cache(tmp_path, monkeypatch):
    """device_call.sh carries one inductor cache between sessions; ours' train stage (an eagle3ctl pipeline call)
    must compile into it as speculators' trainer does, or every session compiles ours afresh (~40 s)."""
    envs = []
    monkeypatch.setattr(run_quality.Bench, "sh", lambda self, cmd, reserve_s=5.0, env=None: envs.append(env) or 0)
    monkeypatch.setattr(run_quality.Bench, "config", lambda self, vocab, run=None: tmp_path / f"q-v{vocab}.yaml")
    bench = _bench(tmp_path, vocabs=[512])
    assert bench.pipeline(512, "train") == 0
    assert envs == [{"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "work" / "inductor")}]
    assert envs[0] == bench.inductor_env()  # the folder speculators' steps use


def test_the_curve_starts_when_its_slowest_recorded_point_fits(tmp_path, monkeypatch):
    """The curve step waited for a flat 75 s: a final point that takes 26-38 s (H100, inductor cache carried) was
    skipped with 45 s left (eleventh session). It now needs its slowest point recorded on this machine, + 5 s;
    before any point recorded its time, the flat estimate."""
    monkeypatch.setattr(run_quality.Bench, "step_curve", lambda self: {"points": 1})
    bench = _bench(tmp_path, tiny=False, budget_s=45, sides=("ours",), vocabs=[512])
    assert re.fullmatch(r"skipped: 4\ds left, needs ~75s", bench.run(["curve"])["status"]["curve"])
    point = bench.point_file(512, "ours", 200)
    point.parent.mkdir(parents=True)
    point.write_text(json.dumps({"step": 200, "evaluator": bench.evaluator(), "seconds": 38.2}))
    assert bench.run(["curve"])["status"]["curve"].startswith("done")
    point.write_text(json.dumps({"step": 200, "evaluator": bench.evaluator(), "seconds": 61.0}))
    assert re.fullmatch(r"skipped: 4\ds left, needs ~66s", bench.run(["curve"])["status"]["curve"])


def test_each_curve_point_after_the_first_waits_for_the_slowest_recorded_point(tmp_path, monkeypatch):
    """Within the curve step the same rule holds as at its start: the next point needs the slowest point recorded
    on this machine + 5 s, so a fast first point in this call does not start a slow one the deadline cuts."""
    import importlib
    import time

    flags = ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--tiny", "--draft-vocabs", "512",
             "--sides", "ours,spec", "--train-steps", "1000"]
    step_curves_module = importlib.import_module("curve")  # what step_curve imports, by the script's own name
    bench = run_quality.Bench(run_quality.parse_args(flags))
    bench.save("ours_v512", {"final_step": 1000, **bench.recipe("ours")})
    for step in (200, 1000):
        snap = bench.snapshots("ours", 512) / f"step-{step:07d}"
        snap.mkdir(parents=True)
        (snap / curve.MODEL).write_bytes(b"w")
    (bench.snapshots("ours", 512) / "drafter_config.json").write_text("{}")
    slow = bench.point_file(512, "spec", 1000)  # speculators' final, decoded earlier on this machine in 30 s
    slow.parent.mkdir(parents=True)
    slow.write_text(json.dumps({"step": 1000, "evaluator": bench.evaluator(), "seconds": 30.0}))
    decoded = []

    def decode_double(config, export):  # a test double of curve.evaluate_export: instant, 20 s left after it
        decoded.append(export.name)
        bench.deadline = time.monotonic() + 20
        return {"mean_acceptance_length": 3.0, "per_prompt": []}

    monkeypatch.setattr(step_curves_module, "evaluate_export", decode_double)
    monkeypatch.setattr(step_curves_module, "export_our_checkpoint", lambda *a: None)
    with pytest.raises(run_quality.StepFailed, match="deadline: 1 points evaluated"):
        bench.step_curve()
    assert decoded == ["step-0001000"]  # the final first; step 200 (needs ~35 s) waits for the next call


def _race_state(work: Path) -> dict[str, str]:
    """sha256 of every file of the race's own: its results, recipes, snapshots, curve points and committed runs
    (a store's _verified.json excepted: adopting hard-links the objects, which records their new fingerprints)."""
    import hashlib

    files = [p for d in ("results", "recipes", "snapshots", "curve", "store/q-v512") for p in (work / d).rglob("*")
             if p.is_file() and p.name != "_verified.json"]
    return {str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.slow
def test_a_sweep_setting_cut_and_resumed_never_touches_the_races_training_points_or_runs(tmp_path):
    """The real harness on the CPU (tiny target, ours only): the race, then a setting of another lr (as
    device_call.sh's sweep runs it), first cut by its deadline, then resumed. A setting used to retrain ours in the
    race's own folder and run, replacing the race's training; now every file of the race's is what it was, the
    setting trained in sweep/<name>/ and a run of its own, and the race's next call finds its own training done."""
    work, out = tmp_path / "w", tmp_path / "o"
    race = [sys.executable, str(REPO / "benchmarks/quality/run_quality.py"), "--work", str(work), "--out", str(out),
            "--tiny", "--draft-vocabs", "512", "--sides", "ours"]
    setting = [*race, "--steps", "ours,curve", "--retrain", "--lr", "1e-3", "--setting", "adamw_1e-3"]

    def run(cmd: list[str], budget: int) -> dict:
        done = subprocess.run([*cmd, "--budget-s", str(budget)], cwd=REPO, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads((out / "quality_race.json").read_text())["status"]

    status = run(race, 600)
    assert status["ours_v512"].startswith("done in") and status["curve"].startswith("done in"), status
    before = _race_state(work)
    assert any(k.startswith("curve/ours-v512/") for k in before) and any(k.startswith("store/q-v512/train/") for k in before)
    cut = run(setting, 22)  # the deadline stops it somewhere in its adoption or training
    assert not cut["ours_v512"].startswith("done"), cut
    assert _race_state(work) == before
    status = run(setting, 600)
    assert status["ours_v512"].startswith("done in") and status["curve"].startswith("done in"), status
    assert _race_state(work) == before
    own = work / "sweep" / "adamw_1e-3"
    assert json.loads((own / "results" / "ours_v512.json").read_text())["lr"] == 1e-3
    assert json.loads((work / "results" / "ours_v512.json").read_text())["lr"] == 5e-4
    assert list((own / "curve" / "ours-v512").glob("step-*.json"))
    runs = {p.name for p in (work / "store").iterdir() if p.is_dir()}
    assert len(runs) == 2 and "q-v512" in runs  # the setting's run: q-v512-<8 hex of its name>
    assert run([*race, "--steps", "ours,curve,plot"], 600)["ours_v512"] == "done earlier"
