"""device_call.sh's sweep: each of ours' settings trained on one target, kept under its own name, and put back
for speculators to race. Run with a stand-in harness (a test double of run_quality.py that records its flags and
writes what a finished setting leaves; the sweep's up-front check of every setting's flags, run_quality.py --check,
goes to the real run_quality.py) and stand-ins for nvidia-smi and pip: the GPU machine is not here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HARNESS_DOUBLE = """
import json, sys
from pathlib import Path
argv = sys.argv[1:]
work, out = Path(argv[argv.index("--work") + 1]), Path(argv[argv.index("--out") + 1])
with open(work / "calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\\n")
flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}  # the last one wins
recipe = {"optimizer": flags["--optimizer"], "lr": float(flags["--lr"]), "lm_head": flags.get("--lm-head", "target")}
kept = work / "results" / "ours_v512.json"
if "ours" in flags["--steps"].split(","):  # ours trains (a sweep setting's, or the race's) and its final point is evaluated
    curve = "skipped: 40s left, needs ~75s" if (work / "cut_curve").exists() else "done in 1s"  # a deadline
    if kept.exists() and "--retrain" not in argv:  # as run_quality: a result of another recipe is named and kept
        old = json.loads(kept.read_text())
        ours = "done earlier" if old == recipe else f"done earlier with lr {old['lr']} (now {recipe['lr']}) (--retrain trains it again)"
    else:
        for d, name in (("results", "ours_v512.json"), ("recipes", "ours-v512.json"), ("curve", "ours-v512/step-0001000.json")):
            (work / d / name).parent.mkdir(parents=True, exist_ok=True)
            (work / d / name).write_text(json.dumps(recipe))
        (work / "snapshots" / "ours-v512").mkdir(parents=True, exist_ok=True)
        ours = "done in 1s"
    (out / "quality_race.json").write_text(json.dumps({"status": {"ours_v512": ours, "curve": curve}}))
elif flags["--steps"] == "curve,plot":  # the race's curve alone: ours as it is
    (out / "quality_race.json").write_text(json.dumps({"status": {"curve": "done in 1s", "plot": "done in 0.1s"}}))
elif (work / "race_dies").exists():  # a race that ends before its report (a crash, the call's limit)
    sys.exit(1)
else:  # a race: speculators trains at the flags' recipe against the ours' result it finds
    (work / "results" / "spec_v512.json").write_text(json.dumps(recipe))
    ours = json.loads((work / "results" / "ours_v512.json").read_text())
    (out / "quality_race.json").write_text(json.dumps({"status": {"spec_v512": "done in 1s"}, "ours": ours}))
    (out / "acceptance_vs_steps.png").write_bytes(b"test double of a plot")
"""


def _sweep(tmp_path: Path, settings: str, *flags: str, mode: str = "sweep") -> subprocess.CompletedProcess:
    """device_call.sh sweep (or ``mode``: quality, ``settings`` then its steps) with the doubles on PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (tmp_path / "harness_double.py").write_text(HARNESS_DOUBLE)
    (stubs / "python3").write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = benchmarks/quality/run_quality.py ]; then [ "${{@: -1}}" = --check ] && exec {sys.executable} "$@"; '
        f'shift; exec {sys.executable} {tmp_path}/harness_double.py "$@"; fi\n'
        '[ "$1" = -m ] && exit 0  # pip: the wheels are the GPU machine\'s\n'
        '[[ $1 == -c && $2 == "import torch, transformers"* ]] && { echo "versions: test double"; exit 0; }\n'
        f'exec {sys.executable} "$@"\n')
    (stubs / "nvidia-smi").write_text("#!/bin/bash\necho 'test double of nvidia-smi'\n")
    (stubs / "cp").write_text(  # a full disk while a setting is kept, into the folder the test names
        '#!/bin/bash\nif [ -e "$E3Q/disk_full" ]; then for a; do [[ $a == *.part/$(cat "$E3Q/disk_full")* ]] && '
        '{ echo "cp: No space left on device (test double)" >&2; exit 1; }; done; fi\nexec /bin/cp "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "carried").mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "E3Q": str(tmp_path / "e3q"),
           "OUT": str(tmp_path / "out"), "CARRIED": str(tmp_path / "carried")}
    (tmp_path / "e3q").mkdir(exist_ok=True)
    return subprocess.run(["bash", "benchmarks/quality/device_call.sh", mode, "600", settings, *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)


def _calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "e3q" / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_setting_passes_ours_flags_after_the_races_and_is_kept_under_its_name(tmp_path):
    done = _sweep(tmp_path, "muon:2e-3:lm-head=target-frozen:min-lr-ratio=0 adamw:5e-4", "--draft-vocabs", "512",
                  "--lm-head", "target")
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = _calls(tmp_path)
    assert first[first.index("--optimizer"):first.index("--checkpoint-every")] == [
        "--optimizer", "muon", "--lr", "2e-3", "--lm-head", "target-frozen", "--min-lr-ratio", "0"]
    assert first.index("--lm-head") < first.index("--lm-head", first.index("--optimizer"))  # the setting's comes last
    assert second[second.index("--optimizer"):second.index("--checkpoint-every")] == ["--optimizer", "adamw", "--lr", "5e-4"]
    name = "muon_2e-3_lm-head-target-frozen_min-lr-ratio-0"
    kept = tmp_path / "e3q" / "sweep" / name / "results" / "ours_v512.json"
    assert json.loads(kept.read_text()) == {"optimizer": "muon", "lr": 0.002, "lm_head": "target-frozen"}
    assert (tmp_path / "out" / f"sweep_{name}.json").exists() and (tmp_path / "out" / "sweep_adamw_5e-4.json").exists()
    # kept settings are not trained again; restore puts the named one back as ours' result
    done = _sweep(tmp_path, f"muon:2e-3:lm-head=target-frozen:min-lr-ratio=0 restore:{name}")
    assert done.returncode == 0 and len(_calls(tmp_path)) == 2
    assert f"{name} kept earlier" in done.stdout and f"ours is the {name} training again" in done.stdout
    assert json.loads((tmp_path / "e3q" / "results" / "ours_v512.json").read_text())["lm_head"] == "target-frozen"


def test_a_setting_piece_that_is_not_flag_equals_value_ends_the_call_in_one_line_before_any_trains(tmp_path):
    done = _sweep(tmp_path, "muon:2e-3 muon:4e-3:frozen", "--draft-vocabs", "512")
    assert done.returncode == 1 and _calls(tmp_path) == []  # the first, well formed, did not train either
    assert [line for line in done.stdout.splitlines() if line.startswith("sweep:")] == [
        "sweep: frozen in muon:4e-3:frozen is not flag=value"]


@pytest.mark.parametrize("setting", ["race:muon_2e-3_lm-head-target-frozen", "muon:fast", "muon"])
def test_a_race_given_a_kept_name_or_a_setting_with_no_optimizer_or_lr_is_refused_before_any_trains(tmp_path, setting):
    """race: takes the setting, restore: the name. Read as a setting, the name muon_2e-3_... was an optimizer with
    no lr: its race was said not kept and skipped while the rest of the sweep trained (the thirteenth session lost
    its race so). Now the call ends at once, before the well-formed setting ahead of it trains."""
    assert _sweep(tmp_path, "muon:2e-3:lm-head=target-frozen", "--draft-vocabs", "512").returncode == 0
    done = _sweep(tmp_path, f"muon:4e-3 {setting}", "--draft-vocabs", "512")
    assert done.returncode == 1 and len(_calls(tmp_path)) == 1, done.stdout
    said = f"sweep: {setting.removeprefix('race:')} is not OPTIMIZER:LR[:flag=value...] (race: takes the setting; "
    assert [line for line in done.stdout.splitlines() if line.startswith("sweep:")] == [said + "restore: the kept name)"]


@pytest.mark.parametrize(("setting", "said"), [
    ("sgd:1e-3", "argument --optimizer: invalid choice: 'sgd'"),
    ("muon:2e-3:lm-head=frozen", "argument --lm-head: invalid choice: 'frozen'"),
    ("race:muon:2e-3:teacher-temp=0.03", "unrecognized arguments: --teacher-temp 0.03"),
    ("muon:2e-3:ttt-decay=1.5", "--ttt-decay in (0, 1]"),
])
def test_a_setting_run_quality_would_refuse_ends_the_call_in_one_line_before_any_trains(tmp_path, setting, said):
    """Well formed, but a value run_quality refuses: such a setting used to fail only when its turn came, after the
    settings ahead of it had trained (device time gone). Every setting's flags now go through run_quality's own
    parser (--check) first; an abbreviated flag, which argparse would take for the whole one while the kept name
    keeps the abbreviation, is refused too."""
    done = _sweep(tmp_path, f"muon:2e-3 {setting}", "--draft-vocabs", "512")
    assert done.returncode == 1 and _calls(tmp_path) == [], done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("sweep:")]
    assert len(lines) == 1 and lines[0].startswith(f"sweep: {setting.removeprefix('race:')} refused: "), lines
    assert said in lines[0]


def test_a_restore_that_fails_midway_leaves_ours_untrained_not_half_restored(tmp_path):
    """results/ is the done marker: it goes first and comes back last, so a restore cut before the end (here a
    kept setting whose curve folder cannot be copied) leaves no result that names a training not all there."""
    assert _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512").returncode == 0
    kept = tmp_path / "e3q" / "sweep" / "muon_2e-3"
    shutil.rmtree(kept / "curve")
    (kept / "curve").write_text("not a folder")
    done = _sweep(tmp_path, "restore:muon_2e-3")
    assert done.returncode == 1 and "sweep: restoring muon_2e-3 failed at curve/" in done.stdout
    assert not (tmp_path / "e3q" / "results" / "ours_v512.json").exists()


def test_a_restore_that_fails_after_the_curve_leaves_no_setting_point_under_the_races_name(tmp_path):
    """A restore cut after curve/ is copied (here at recipes/), with ours the race's before it: the setting's
    points now in curve/ must not come back as the race's in a later call's archive."""
    assert _sweep(tmp_path, "muon:2e-3 race:muon:2e-3", "--draft-vocabs", "512").returncode == 0
    assert "curve/ours-v512/step-0001000.json" in _points(tmp_path)  # raced: ours' points are the race's
    kept = tmp_path / "e3q" / "sweep" / "muon_2e-3"
    shutil.rmtree(kept / "recipes")
    (kept / "recipes").write_text("not a folder")
    assert _sweep(tmp_path, "restore:muon_2e-3").returncode == 1
    assert (tmp_path / "e3q" / "curve" / "ours-v512" / "step-0001000.json").exists()  # copied before the cut
    assert _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512").returncode == 0  # kept earlier: only the points
    assert "curve/ours-v512/step-0001000.json" not in _points(tmp_path)


def test_a_race_puts_the_kept_setting_back_and_races_speculators_at_its_recipe(tmp_path):
    """race:<setting> after a later setting trained: ours must be the raced setting's training again, and
    speculators must train at that setting's optimizer, lr and ours' flags; the report keeps the setting's name."""
    frozen = "muon:2e-3:lm-head=target-frozen"
    done = _sweep(tmp_path, f"{frozen} muon:4e-3 race:{frozen}", "--draft-vocabs", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    race = _calls(tmp_path)[2]
    assert race[race.index("--steps") + 1] == "spec_data,spec,curve,plot" and race[-1] == "--retrain"
    assert race[race.index("--optimizer"):race.index("--retrain")] == [
        "--optimizer", "muon", "--lr", "2e-3", "--lm-head", "target-frozen"]
    name = "muon_2e-3_lm-head-target-frozen"
    out = tmp_path / "out"
    report = json.loads((out / f"race_{name}.json").read_text())
    assert report["ours"] == {"optimizer": "muon", "lr": 0.002, "lm_head": "target-frozen"}  # not the 4e-3 training
    assert (out / f"race_{name}.png").exists() and not (out / "quality_race.json").exists()


def test_a_race_against_a_setting_not_kept_is_not_run(tmp_path):
    """A setting whose training a deadline cut is not kept: its race must not run against whatever ours holds."""
    assert _sweep(tmp_path, "muon:4e-3", "--draft-vocabs", "512").returncode == 0
    done = _sweep(tmp_path, "race:muon:2e-3", "--draft-vocabs", "512")
    assert done.returncode == 0 and len(_calls(tmp_path)) == 1
    assert "sweep: muon_2e-3 not kept: no race against it" in done.stdout


def test_a_setting_whose_final_point_the_deadline_skipped_is_not_kept(tmp_path):
    (tmp_path / "e3q").mkdir()
    (tmp_path / "e3q" / "cut_curve").write_text("")
    done = _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512")
    assert done.returncode == 0 and len(_calls(tmp_path)) == 1
    assert not (tmp_path / "e3q" / "sweep" / "muon_2e-3").exists() and "muon_2e-3 kept" not in done.stdout
    assert not (tmp_path / "out" / "sweep_muon_2e-3.json").exists()
    assert not (tmp_path / "out" / "curve_points.tgz").exists()  # its cut training's point is no race's either
    (tmp_path / "e3q" / "cut_curve").unlink()  # the next call trains it again and keeps it
    assert "sweep: muon_2e-3 kept" in _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512").stdout


@pytest.mark.parametrize("folder", ["curve", "results"])  # one mid-way, and the last (the done marker)
def test_a_setting_whose_copy_fails_is_not_kept_half(tmp_path, folder):
    """A full disk while a setting's training is copied aside: a kept setting must be whole (restore: and race:
    trust it), so the half copy is dropped, said in one line, and the next call trains the setting again."""
    (tmp_path / "e3q").mkdir()
    (tmp_path / "e3q" / "disk_full").write_text(folder)  # the copy into this kept folder fails
    done = _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"sweep: keeping muon_2e-3 failed at {folder}/: not kept" in done.stdout
    assert not (tmp_path / "e3q" / "sweep" / "muon_2e-3").exists()
    assert not (tmp_path / "e3q" / "sweep" / "muon_2e-3.part").exists()
    assert not (tmp_path / "out" / "sweep_muon_2e-3.json").exists()
    (tmp_path / "e3q" / "disk_full").unlink()
    assert "sweep: muon_2e-3 kept" in _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512").stdout


def _points(tmp_path: Path) -> set[str]:
    with tarfile.open(tmp_path / "out" / "curve_points.tgz") as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


def test_a_setting_trained_in_place_does_not_come_back_as_the_races_points(tmp_path):
    """The eighteenth session's call 3: a setting retrained ours after the race, and the call's curve_points.tgz
    held the setting's point as curve/ours-v32768, the race's name. It must come back under sweep/<name>/ only,
    until a race names ours again (race:<setting>, or the race's own call training ours)."""
    e3q = tmp_path / "e3q"
    for side in ("ours", "spec"):  # the race's points, from an earlier call on this machine
        (e3q / "curve" / f"{side}-v512").mkdir(parents=True)
        (e3q / "curve" / f"{side}-v512" / "step-0001000.json").write_text('{"race": true}')
    done = _sweep(tmp_path, "adamw:5e-4", "--draft-vocabs", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _points(tmp_path) == {"curve/spec-v512/step-0001000.json",
                                 "sweep/adamw_5e-4/curve/ours-v512/step-0001000.json"}
    assert "ours in curve/ is the sweep's adamw_5e-4 training, not the race's: left out" in done.stdout
    done = _sweep(tmp_path, "race:adamw:5e-4", "--draft-vocabs", "512")  # raced: the report names ours
    assert done.returncode == 0, done.stdout + done.stderr
    assert "curve/ours-v512/step-0001000.json" in _points(tmp_path)
    assert _sweep(tmp_path, "restore:adamw_5e-4").returncode == 0  # put back with no race: a setting's again
    assert "curve/ours-v512/step-0001000.json" not in _points(tmp_path)
    done = _sweep(tmp_path, "ours,curve", "--draft-vocabs", "512", "--optimizer", "muon", "--lr", "2e-3", "--retrain",
                  mode="quality")
    assert done.returncode == 0, done.stdout + done.stderr  # the race's call trains ours at its own recipe again
    assert "curve/ours-v512/step-0001000.json" in _points(tmp_path)


def test_a_race_that_writes_no_report_leaves_ours_the_settings(tmp_path):
    """race:<setting> puts the setting back, and only its report (race_<name>.json) names ours' points as that
    race's: a race that dies before writing one must not send the setting's points back under curve/."""
    assert _sweep(tmp_path, "adamw:5e-4", "--draft-vocabs", "512").returncode == 0
    (tmp_path / "e3q" / "race_dies").write_text("")
    done = _sweep(tmp_path, "race:adamw:5e-4", "--draft-vocabs", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "out" / "race_adamw_5e-4.json").exists()
    assert "curve/ours-v512/step-0001000.json" not in _points(tmp_path)
    (tmp_path / "e3q" / "race_dies").unlink()
    assert _sweep(tmp_path, "race:adamw:5e-4", "--draft-vocabs", "512").returncode == 0
    assert "curve/ours-v512/step-0001000.json" in _points(tmp_path)


def test_a_race_call_that_keeps_a_settings_training_of_another_recipe_does_not_send_it_as_the_races(tmp_path):
    """A race call naming ours but without --retrain keeps a result of another recipe (run_quality says "done earlier
    with ..."), and one that does not name ours leaves it as it is: ours is still the setting's training then, and its
    points in curve/ must stay out. Only a run whose report says ours is of its own recipe makes them the race's."""
    assert _sweep(tmp_path, "adamw:5e-4", "--draft-vocabs", "512").returncode == 0  # ours: the setting's training
    race = ("--draft-vocabs", "512", "--optimizer", "muon", "--lr", "2e-3")
    for steps in ("ours,curve", "curve,plot"):
        done = _sweep(tmp_path, steps, *race, mode="quality")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "curve/ours-v512/step-0001000.json" not in _points(tmp_path), steps
        assert "ours in curve/ is the sweep's adamw_5e-4 training, not the race's: left out" in done.stdout
    assert json.loads((tmp_path / "e3q" / "results" / "ours_v512.json").read_text())["lr"] == 5e-4  # kept, not trained
    done = _sweep(tmp_path, "ours,curve", "--draft-vocabs", "512", "--optimizer", "adamw", "--lr", "5e-4", mode="quality")
    assert done.returncode == 0, done.stdout + done.stderr  # the race asks for the setting's recipe: "done earlier"
    assert "curve/ours-v512/step-0001000.json" in _points(tmp_path)
