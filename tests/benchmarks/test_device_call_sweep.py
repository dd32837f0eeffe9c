"""device_call.sh's sweep: each of ours' settings trained on one target in a folder of its own, marked finished
once its final point is evaluated, and raced by speculators there. Run with a stand-in harness (a test double of
run_quality.py that records its flags and writes, under --work/sweep/<--setting>, what a setting's training leaves;
the sweep's up-front check of every setting's flags, run_quality.py --check, goes to the real run_quality.py) and
stand-ins for nvidia-smi and pip: the GPU machine is not here. That a setting leaves the race's own training, points
and runs untouched is run_quality's to keep, tested with the real harness in test_quality_race.py."""

from __future__ import annotations

import json
import os
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
own = work / "sweep" / flags["--setting"] if "--setting" in flags else work
recipe = {"optimizer": flags["--optimizer"], "lr": float(flags["--lr"]), "lm_head": flags.get("--lm-head", "target")}
if (work / "dies").exists():  # a run that ends before its report (a crash, the call's limit)
    sys.exit(1)
if "ours" in flags["--steps"].split(","):  # ours trains and its final point is evaluated
    curve = "skipped: 40s left, needs ~75s" if (work / "cut_curve").exists() else "done in 1s"  # a deadline
    kept = own / "results" / "ours_v512.json"
    if kept.exists() and json.loads(kept.read_text()) == recipe:  # as run_quality: a finished training resumes as done
        ours = "done earlier"
    else:
        for d, name in (("results", "ours_v512.json"), ("curve", "ours-v512/step-0001000.json")):
            (own / d / name).parent.mkdir(parents=True, exist_ok=True)
            (own / d / name).write_text(json.dumps(recipe))
        ours = "done in 1s"
    (out / "quality_race.json").write_text(json.dumps({"status": {"ours_v512": ours, "curve": curve}}))
else:  # a race: speculators trains at the flags' recipe against the ours' result it finds in the same folder
    (own / "results" / "spec_v512.json").write_text(json.dumps(recipe))
    ours = json.loads((own / "results" / "ours_v512.json").read_text())
    (out / "quality_race.json").write_text(json.dumps({"status": {"spec_v512": "done in 1s"}, "ours": ours}))
    (out / "acceptance_vs_steps.png").write_bytes(b"test double of a plot")
"""


def _sweep(tmp_path: Path, settings: str, *flags: str) -> subprocess.CompletedProcess:
    """device_call.sh sweep with the doubles on PATH."""
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
    (stubs / "cp").write_text(  # a full disk while a setting's finished mark is written
        '#!/bin/bash\nif [ -e "$E3Q/disk_full" ]; then for a; do [[ $a == */finished.json.part ]] && '
        '{ echo "cp: No space left on device (test double)" >&2; exit 1; }; done; fi\nexec /bin/cp "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "carried").mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "E3Q": str(tmp_path / "e3q"),
           "OUT": str(tmp_path / "out"), "CARRIED": str(tmp_path / "carried")}
    (tmp_path / "e3q").mkdir(exist_ok=True)
    return subprocess.run(["bash", "benchmarks/quality/device_call.sh", "sweep", "600", settings, *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)


def _calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "e3q" / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []



def _points(tmp_path: Path) -> set[str]:
    with tarfile.open(tmp_path / "out" / "curve_points.tgz") as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


def test_a_setting_passes_ours_flags_after_the_races_and_trains_in_its_own_folder(tmp_path):
    done = _sweep(tmp_path, "muon:2e-3:lm-head=target-frozen:min-lr-ratio=0 adamw:5e-4", "--draft-vocabs", "512",
                  "--lm-head", "target")
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = _calls(tmp_path)
    name = "muon_2e-3_lm-head-target-frozen_min-lr-ratio-0"
    assert first[first.index("--optimizer"):first.index("--checkpoint-every")] == [
        "--optimizer", "muon", "--lr", "2e-3", "--lm-head", "target-frozen", "--min-lr-ratio", "0", "--setting", name]
    assert first.index("--lm-head") < first.index("--lm-head", first.index("--optimizer"))  # the setting's comes last
    assert second[second.index("--optimizer"):second.index("--checkpoint-every")] == [
        "--optimizer", "adamw", "--lr", "5e-4", "--setting", "adamw_5e-4"]
    e3q = tmp_path / "e3q"
    assert json.loads((e3q / "sweep" / name / "results" / "ours_v512.json").read_text()) == {
        "optimizer": "muon", "lr": 0.002, "lm_head": "target-frozen"}
    assert not (e3q / "results").exists()  # nothing in the race's own folder
    for setting in (name, "adamw_5e-4"):
        assert (tmp_path / "out" / f"sweep_{setting}.json").exists()
        assert (e3q / "sweep" / setting / "finished.json").exists()
    assert _points(tmp_path) == {f"sweep/{name}/curve/ours-v512/step-0001000.json",
                                 "sweep/adamw_5e-4/curve/ours-v512/step-0001000.json"}
    done = _sweep(tmp_path, "muon:2e-3:lm-head=target-frozen:min-lr-ratio=0")  # finished: not run again
    assert done.returncode == 0 and len(_calls(tmp_path)) == 2 and f"sweep: {name} finished earlier" in done.stdout


def test_a_setting_piece_that_is_not_flag_equals_value_ends_the_call_in_one_line_before_any_trains(tmp_path):
    done = _sweep(tmp_path, "muon:2e-3 muon:4e-3:frozen", "--draft-vocabs", "512")
    assert done.returncode == 1 and _calls(tmp_path) == []  # the first, well formed, did not train either
    assert [line for line in done.stdout.splitlines() if line.startswith("sweep:")] == [
        "sweep: frozen in muon:4e-3:frozen is not flag=value"]


@pytest.mark.parametrize("setting", ["race:muon_2e-3_lm-head-target-frozen", "muon:fast", "muon"])
def test_a_race_given_a_settings_name_or_a_setting_with_no_optimizer_or_lr_is_refused_before_any_trains(tmp_path, setting):
    """race: takes the setting. Read as a setting, the name muon_2e-3_... was an optimizer with no lr: its race was
    said not kept and skipped while the rest of the sweep trained (the thirteenth session lost its race so). Now the
    call ends at once, before the well-formed setting ahead of it trains."""
    assert _sweep(tmp_path, "muon:2e-3:lm-head=target-frozen", "--draft-vocabs", "512").returncode == 0
    done = _sweep(tmp_path, f"muon:4e-3 {setting}", "--draft-vocabs", "512")
    assert done.returncode == 1 and len(_calls(tmp_path)) == 1, done.stdout
    said = f"sweep: {setting.removeprefix('race:')} is not OPTIMIZER:LR[:flag=value...] (race: takes the setting, not its name)"
    assert [line for line in done.stdout.splitlines() if line.startswith("sweep:")] == [said]


@pytest.mark.parametrize(("setting", "said"), [
    ("sgd:1e-3", "argument --optimizer: invalid choice: 'sgd'"),
    ("muon:2e-3:lm-head=frozen", "argument --lm-head: invalid choice: 'frozen'"),
    ("race:muon:2e-3:teacher-temp=0.03", "unrecognized arguments: --teacher-temp 0.03"),
    ("muon:2e-3:ttt-decay=1.5", "--ttt-decay in (0, 1]"),
    ("muon:2e-3:setting=../race", "--setting"),  # a name is the sweep's to give, and never a path
])
def test_a_setting_run_quality_would_refuse_ends_the_call_in_one_line_before_any_trains(tmp_path, setting, said):
    """Well formed, but a value run_quality refuses: such a setting used to fail only when its turn came, after the
    settings ahead of it had trained (device time gone). Every setting's flags now go through run_quality's own
    parser (--check) first; an abbreviated flag, which argparse would take for the whole one while the setting's
    name keeps the abbreviation, is refused too."""
    done = _sweep(tmp_path, f"muon:2e-3 {setting}", "--draft-vocabs", "512")
    assert done.returncode == 1 and _calls(tmp_path) == [], done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("sweep:")]
    assert len(lines) == 1 and lines[0].startswith(f"sweep: {setting.removeprefix('race:')} refused: "), lines
    assert said in lines[0]


def test_a_race_runs_speculators_in_the_settings_folder_at_its_recipe_against_its_training(tmp_path):
    """race:<setting> after a later setting trained: speculators must race the raced setting's training, at that
    setting's optimizer, lr and ours' flags; the report keeps the setting's name."""
    frozen = "muon:2e-3:lm-head=target-frozen"
    done = _sweep(tmp_path, f"{frozen} muon:4e-3 race:{frozen}", "--draft-vocabs", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    race = _calls(tmp_path)[2]
    name = "muon_2e-3_lm-head-target-frozen"
    assert race[race.index("--steps") + 1] == "spec_data,spec,curve,plot" and race[-1] == "--retrain"
    assert race[race.index("--optimizer"):race.index("--retrain")] == [
        "--optimizer", "muon", "--lr", "2e-3", "--lm-head", "target-frozen", "--setting", name]
    out = tmp_path / "out"
    report = json.loads((out / f"race_{name}.json").read_text())
    assert report["ours"] == {"optimizer": "muon", "lr": 0.002, "lm_head": "target-frozen"}  # not the 4e-3 training
    assert (tmp_path / "e3q" / "sweep" / name / "results" / "spec_v512.json").exists()
    assert (out / f"race_{name}.png").exists() and not (out / "quality_race.json").exists()


def test_a_race_against_a_setting_not_finished_is_not_run(tmp_path):
    """A setting whose training a deadline cut is not finished: speculators' training (minutes) must not run
    against it."""
    assert _sweep(tmp_path, "muon:4e-3", "--draft-vocabs", "512").returncode == 0
    done = _sweep(tmp_path, "race:muon:2e-3", "--draft-vocabs", "512")
    assert done.returncode == 0 and len(_calls(tmp_path)) == 1
    assert "sweep: muon_2e-3 not finished: no race against it" in done.stdout


def test_a_setting_whose_final_point_the_deadline_skipped_is_not_finished_and_runs_again(tmp_path):
    (tmp_path / "e3q").mkdir()
    (tmp_path / "e3q" / "cut_curve").write_text("")
    done = _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512")
    assert done.returncode == 0 and len(_calls(tmp_path)) == 1
    assert "muon_2e-3 finished" not in done.stdout and not (tmp_path / "out" / "sweep_muon_2e-3.json").exists()
    assert not (tmp_path / "e3q" / "sweep" / "muon_2e-3" / "finished.json").exists()
    (tmp_path / "e3q" / "cut_curve").unlink()  # the next call runs it again: its training done, the point evaluated
    done = _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512")
    assert "sweep: muon_2e-3 finished" in done.stdout and len(_calls(tmp_path)) == 2
    report = json.loads((tmp_path / "out" / "sweep_muon_2e-3.json").read_text())
    assert report["status"]["ours_v512"] == "done earlier"  # resumed in its folder, not trained again


def test_a_setting_whose_run_dies_before_its_report_is_not_finished(tmp_path):
    (tmp_path / "e3q").mkdir()
    (tmp_path / "e3q" / "dies").write_text("")
    done = _sweep(tmp_path, "muon:2e-3 race:muon:2e-3", "--draft-vocabs", "512")
    assert done.returncode == 0 and len(_calls(tmp_path)) == 1
    assert "sweep: muon_2e-3 not finished: no race against it" in done.stdout
    assert not (tmp_path / "e3q" / "sweep" / "muon_2e-3" / "finished.json").exists()


def test_a_finished_mark_that_cannot_be_written_leaves_the_setting_unfinished_and_whole(tmp_path):
    """A full disk while the finished mark is written: no half mark (a race would trust it); the next call runs the
    setting again and marks it."""
    (tmp_path / "e3q").mkdir()
    (tmp_path / "e3q" / "disk_full").write_text("")
    done = _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    kept = tmp_path / "e3q" / "sweep" / "muon_2e-3"
    assert not (kept / "finished.json").exists() and "sweep: muon_2e-3 finished" not in done.stdout
    assert not (tmp_path / "out" / "sweep_muon_2e-3.json").exists()
    (tmp_path / "e3q" / "disk_full").unlink()
    assert "sweep: muon_2e-3 finished" in _sweep(tmp_path, "muon:2e-3", "--draft-vocabs", "512").stdout
    assert json.loads((kept / "finished.json").read_text())["status"]["ours_v512"] == "done earlier"
