"""The quality race's summary (benchmarks/quality/summarize.py): intervals, ratios, refusals; its plot."""

from __future__ import annotations

import json
import random

import pytest

from tests.benchmarks.quality_modules import load

summarize = load("summarize")
acceptance_ratio_ci = summarize.acceptance_ratio_ci


def report(lengths: dict[int, float], steps: int = 50) -> dict:
    return {"per_prompt": [{"id": i, "verify_steps": steps, "mean_acceptance_length": m} for i, m in lengths.items()]}


def test_paired_bootstrap_brackets_the_ratio_and_narrows_with_agreeing_prompts():
    rng = random.Random(1)
    base = {i: 1.5 + rng.random() for i in range(32)}
    same_shift = acceptance_ratio_ci(report({i: m * 1.02 for i, m in base.items()}), report(base))
    assert same_shift["ratio"] == 1.02 and same_shift["ci95"] == [1.02, 1.02]  # paired: prompt difficulty cancels
    noisy = acceptance_ratio_ci(report({i: m + rng.uniform(-0.3, 0.3) for i, m in base.items()}), report(base))
    lo, hi = noisy["ci95"]
    assert lo < noisy["ratio"] < hi and hi - lo > 0.02 and noisy["prompts"] == 32


def test_only_prompts_both_decoded_count():
    ours = report({1: 2.0, 2: 2.0, 3: 9.0})
    theirs = report({1: 1.0, 2: 1.0})
    assert acceptance_ratio_ci(ours, theirs)["ratio"] == 2.0 and acceptance_ratio_ci(ours, theirs)["prompts"] == 2
    assert acceptance_ratio_ci(report({1: 2.0}), theirs) is None  # one shared prompt: no interval


def test_steady_rate_leaves_out_the_start_and_the_profiled_windows():
    records = [{"step": s, "tokens_per_s": r} for s, r in [(5, 10.0), (10, 100.0), (15, 102.0), (20, 30.0), (25, 101.0)]]
    assert summarize.steady(records) == 100.5  # the first 20 % (compiling) is left out, the median of the rest
    # steps 15..16 (0-based) were profiled: the window logged at step 20 (steps 15..19) is left out
    assert summarize.steady(records, profiled=[15, 17]) == 101.0


def test_bootstrap_interval_brackets_the_mean_and_is_seeded():
    rng = random.Random(2)
    rep = report({i: 1.5 + rng.random() for i in range(40)})
    ci = summarize.acceptance_ci(rep)
    lo, hi = ci["ci95"]
    exact = sum(r["mean_acceptance_length"] for r in rep["per_prompt"]) / 40  # equal verify steps: the plain mean
    assert ci["mean_acceptance_length"] == round(exact, 4) and lo < exact < hi and ci["prompts"] == 40
    assert 0.05 < hi - lo < 0.4  # ~1.96 * 0.29 / sqrt(40) * 2 = 0.18 for uniform noise
    assert summarize.acceptance_ci(rep) == ci  # same seed, same interval
    same = summarize.acceptance_ci(report({i: 2.0 for i in range(10)}))
    assert same["ci95"] == [2.0, 2.0]


def test_prompts_weigh_by_their_verify_steps():
    rep = {"per_prompt": [{"id": 0, "verify_steps": 30, "mean_acceptance_length": 1.0},
                          {"id": 1, "verify_steps": 10, "mean_acceptance_length": 3.0}]}
    assert summarize.acceptance_ci(rep)["mean_acceptance_length"] == 1.5  # (30 + 30) / 40


def test_ratios_are_refused_when_a_side_is_missing():
    final = report({i: 2.0 for i in range(4)})
    ours = {"final": final, "final_step": 12, "train": {"steady_tokens_per_s": 300.0, "peak_memory_gib": 2.0}}
    alone = summarize.variant_summary(ours, None)
    assert alone["speculators"] == "not reported: speculators missing"
    assert alone["acceptance_ratio"] == "not reported: speculators missing"
    assert alone["throughput_ratio"] == "not reported: speculators missing"
    assert alone["eagle3ctl"]["acceptance"]["mean_acceptance_length"] == 2.0
    theirs = {"final": report({i: 1.6 for i in range(4)}), "train": {"steady_tokens_per_s": 200.0}}
    both = summarize.variant_summary(ours, theirs)
    assert both["acceptance_ratio"]["ratio"] == 1.25 and both["throughput_ratio"] == 1.5
    assert both["peak_memory_ratio"] == "not reported: speculators missing"  # theirs has no peak memory
    assert summarize.variant_summary(None, None)["acceptance_ratio"] == "not reported: eagle3ctl, speculators missing"
    untrained = {**theirs, "final_step": 0}  # speculators' --dry-run on CPU: its initialized drafter
    short = summarize.variant_summary(ours, untrained, steps=12)
    assert short["speculators"] == "not reported: speculators (trained 0 of 12 steps) missing"
    assert short["acceptance_ratio"] == "not reported: speculators missing"
    assert short["throughput_ratio"] == "not reported: speculators missing"
    assert isinstance(short["eagle3ctl"], dict)  # 12 of 12 steps


def test_a_race_at_unequal_steps_says_so_beside_its_ratio_and_ours_must_reach_its_own_steps():
    """--ours-train-steps: ours trained 3x speculators' steps in about its training seconds. The ratio is
    reported (the measurement asked for), labelled as not the race the acceptance goal is set for, with each
    side's steady training seconds; ours stopped short of its own steps counts as missing."""
    ours = {"final": report({i: 2.4 for i in range(4)}), "final_step": 3000, "train_steps": 3000,
            "train": {"tokens": 3000 * 16000, "steady_tokens_per_s": 400000.0}}
    spec = {"final": report({i: 2.0 for i in range(4)}), "final_step": 1000, "train_steps": 1000,
            "train": {"mean_tokens_per_step": 16000.0, "steady_tokens_per_s": 125000.0}}
    race = summarize.variant_summary(ours, spec, steps=1000, ours_steps=3000)
    assert race["acceptance_ratio"]["ratio"] == 1.2
    assert race["acceptance_ratio"]["unequal_steps"].startswith("eagle3ctl 3000 steps, speculators 1000 steps: "
                                                                 "a race at equal training seconds")
    assert (race["eagle3ctl"]["steady_train_seconds"], race["speculators"]["steady_train_seconds"]) == (120.0, 128.0)
    short = summarize.variant_summary({**ours, "final_step": 1000}, spec, steps=1000, ours_steps=3000)
    assert short["eagle3ctl"] == "not reported: eagle3ctl (trained 1000 of 3000 steps) missing"
    assert short["acceptance_ratio"] == "not reported: eagle3ctl missing"
    matched = summarize.summarize(None, {512: {"ours": {**ours, "train_steps": 1000, "final_step": 1000},
                                               "spec": spec}}, {}, {"train_steps": 1000})
    assert "unequal_steps" not in matched["headline"]["by_draft_vocab"]["512"]["acceptance_ratio"]
    both = summarize.summarize(None, {512: {"ours": ours, "spec": spec}}, {},
                               {"train_steps": 1000, "ours_train_steps": 3000})["headline"]["by_draft_vocab"]["512"]
    assert "unequal_steps" in both["acceptance_ratio"]
    unknown = summarize.variant_summary({**ours, "train_steps": None}, spec, steps=1000, ours_steps=3000)
    assert "unequal_steps" not in unknown["acceptance_ratio"]  # saved before ours' steps were kept: not known to differ


def test_the_curves_plot_is_a_png(tmp_path):
    plot = load("plot_quality")
    points = [{"step": s, "mean_acceptance_length": 1 + s / 1000, "ci95": [0.9 + s / 1000, 1.1 + s / 1000]}
              for s in (200, 400, 600)]
    curves = {16384: {"eagle3ctl": points, "speculators": points[:2]}, 64000: {"eagle3ctl": points[:1]}}
    path = plot.plot_curves(curves, tmp_path / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert int.from_bytes(path.read_bytes()[16:20], "big") == 840  # one panel: steps (7 in at 120 dpi)
    timed = [{**p, "seconds": p["step"] / 25} for p in points]  # a side whose steady rate is known
    two = plot.plot_curves({16384: {"eagle3ctl": timed, "speculators, 300-step schedule": points}}, tmp_path / "two.png")
    assert int.from_bytes(two.read_bytes()[16:20], "big") == 1440  # and beside it, against training seconds


def test_a_side_trained_but_not_evaluated_keeps_its_training_numbers():
    """A call the deadline cut before the curve still reports throughput and memory; acceptance is refused."""
    ours = {"final": None, "final_step": 12, "draft_vocab_coverage": 0.97,
            "train": {"steady_tokens_per_s": 300.0, "peak_memory_gib": 4.0}}
    theirs = {"final": None, "final_step": 12, "train": {"steady_tokens_per_s": 100.0, "peak_memory_gib": 8.0}}
    s = summarize.variant_summary(ours, theirs, steps=12)
    assert s["draft_vocab_coverage"] == 0.97  # the vocab's share of generated tokens, beside the race it explains
    assert s["throughput_ratio"] == 3.0 and s["peak_memory_ratio"] == 0.5
    assert s["acceptance_ratio"] == "not reported: eagle3ctl, speculators missing"
    assert s["eagle3ctl"]["acceptance"] == "not reported: eagle3ctl's evaluated final checkpoint missing"
    assert s["eagle3ctl"]["train"]["steady_tokens_per_s"] == 300.0


def test_a_further_side_is_raced_against_ours_under_its_own_name():
    """--sides ours,spec,specce: speculators with its ce loss gets its own ratio against ours under "vs", named as
    such in every refusal; the headline race (ours against speculators' default loss) is left as it was."""
    ours = {"final": report({i: 2.4 for i in range(4)}), "final_step": 12, "train": {"steady_tokens_per_s": 300.0}}
    spec = {"final": report({i: 2.0 for i in range(4)}), "final_step": 12, "train": {"steady_tokens_per_s": 100.0}}
    ce = {"final": report({i: 2.2 for i in range(4)}), "final_step": 12, "train": {"steady_tokens_per_s": 120.0}}
    names = {"ours": "eagle3ctl", "spec": "speculators", "specce": "speculators (ce loss)"}
    head = summarize.summarize(None, {512: {"ours": ours, "spec": spec, "specce": ce}}, {}, {"train_steps": 12},
                               names)["headline"]["by_draft_vocab"]["512"]
    assert head["acceptance_ratio"]["ratio"] == 1.2 and head["throughput_ratio"] == 3.0
    vs = head["vs"]["speculators (ce loss)"]
    assert set(vs) == {"speculators (ce loss)", "acceptance_ratio", "throughput_ratio", "peak_memory_ratio"}
    assert vs["acceptance_ratio"]["ratio"] == round(2.4 / 2.2, 4) and vs["throughput_ratio"] == 2.5
    assert vs["speculators (ce loss)"]["acceptance"]["mean_acceptance_length"] == 2.2
    cut = summarize.summarize(None, {512: {"ours": ours, "spec": spec, "specce": {**ce, "final_step": 6}}}, {},
                              {"train_steps": 12}, names)["headline"]["by_draft_vocab"]["512"]["vs"]["speculators (ce loss)"]
    assert cut["acceptance_ratio"] == "not reported: speculators (ce loss) missing"
    assert cut["speculators (ce loss)"] == "not reported: speculators (ce loss) (trained 6 of 12 steps) missing"
    alone = summarize.summarize(None, {512: {"ours": ours, "spec": spec}}, {}, {"train_steps": 12}, names)
    assert "vs" not in alone["headline"]["by_draft_vocab"]["512"]


def test_no_acceptance_ratio_between_sides_trained_with_different_decays():
    """The sixth session's call 4 retrained ours and speculators' ce at TTT decay 0.6; speculators' kl_div kept its
    decay-0.8 result from an earlier call, and the summary raced them as if matched. Now it names the difference;
    each side's recipe is in the summary, a result saved before the recipe was kept read as the old defaults."""
    final = report({i: 2.0 for i in range(4)})
    ours = {"final": final, "final_step": 12, "train": {}, "train_steps": 12, "ttt_decay": 0.6, "teacher_temperature": 0.1}
    ce = {"final": final, "final_step": 12, "train": {}, "train_steps": 12, "ttt_decay": 0.6, "loss_fn": "ce"}
    old = {"final": final, "final_step": 12, "train": {}}  # saved before the recipe was kept: decay 0.8, kl_div
    names = {"ours": "eagle3ctl", "spec": "speculators", "specce": "speculators (ce loss)"}
    head = summarize.summarize(None, {512: {"ours": ours, "spec": old, "specce": ce}}, {}, {"train_steps": 12},
                               names)["headline"]["by_draft_vocab"]["512"]
    assert head["acceptance_ratio"] == "not reported: trained with different recipes (ttt_decay 0.6 vs 0.8)"
    assert head["vs"]["speculators (ce loss)"]["acceptance_ratio"]["ratio"] == 1.0
    assert head["speculators"]["recipe"] == {"train_steps": None, "ttt_decay": 0.8, "optimizer": "adamw", "lr": 5e-4,
                                             "loss_fn": "kl_div"}
    assert head["eagle3ctl"]["recipe"] == {"train_steps": 12, "ttt_decay": 0.6, "optimizer": "adamw", "lr": 5e-4,
                                           "teacher_temperature": 0.1, "lm_head": "target", "min_lr_ratio": 0.1,
                                           "adamw_lr": None, "feature_noise": 0.0, "muon_weight_decay": 0.1,
                                           "seed": 0, "loss_tokens": "assistant"}
    assert head["throughput_ratio"] == "not reported: eagle3ctl, speculators missing"  # no numbers, not refused for recipe


def test_no_acceptance_ratio_between_sides_trained_with_different_optimizers():
    """Muon against AdamW, or one peak lr against another, is a race of recipes, not of trainers."""
    final = report({i: 2.0 for i in range(4)})
    ours = {"final": final, "final_step": 12, "train": {}, "train_steps": 12, "optimizer": "muon", "lr": 2e-3}
    spec = {"final": final, "final_step": 12, "train": {}, "train_steps": 12}  # saved before: AdamW at 5e-4
    same = {**spec, "optimizer": "muon", "lr": 2e-3}
    names = {"ours": "eagle3ctl", "spec": "speculators", "specce": "speculators (ce loss)"}
    head = summarize.summarize(None, {512: {"ours": ours, "spec": spec, "specce": same}}, {}, {"train_steps": 12},
                               names)["headline"]["by_draft_vocab"]["512"]
    assert head["acceptance_ratio"] == ("not reported: trained with different recipes "
                                        "(optimizer muon vs adamw, lr 0.002 vs 0.0005)")
    assert head["vs"]["speculators (ce loss)"]["acceptance_ratio"]["ratio"] == 1.0


def test_paired_compares_two_curve_points_and_refuses_what_it_cannot_pair(tmp_path, capsys):
    """Two of a sweep's settings on one target have no ratio in the race's summary; `summarize.py paired`
    gives one from the points' per-prompt rows, and refuses in one line what would mislead: points of another
    evaluator, unreadable files, no shared prompts."""
    evaluator = {"eval_prompts": 4, "eval_new_tokens": 96, "draft_tokens": 7}

    def point(name, lengths, **extra):
        path = tmp_path / name
        path.write_text(json.dumps({"step": 1000, "evaluator": evaluator, **report(lengths), **extra}))
        return str(path)

    def positions(*conditional):
        return {"acceptance_rate_per_position": {"conditional": list(conditional)}}

    muon = point("muon.json", {0: 4.2, 1: 5.0, 2: 3.1, 3: 4.0}, **positions(0.82, 0.9, 0.95))
    adamw = point("adamw.json", {0: 4.0, 1: 4.8, 2: 3.0, 3: 3.8}, **positions(0.8, 0.9, 0.0))
    summarize.main(["paired", muon, adamw])
    out = json.loads(capsys.readouterr().out)
    assert out["a_over_b"]["prompts"] == 4 and 1.0 < out["a_over_b"]["ratio"] < 1.06
    assert out["a"]["mean_acceptance_length"] == 4.075 and out["b"]["step"] == 1000
    # where the lead comes from: per draft position (a position B never accepted has no ratio)
    assert out["conditional_per_position"] == {"a": [0.82, 0.9, 0.95], "b": [0.8, 0.9, 0.0],
                                               "a_over_b": [1.025, 1.0, None]}
    old = tmp_path / "old.json"  # saved before points kept their evaluator: decoded with the old defaults
    old.write_text(json.dumps({"step": 1000, **report({0: 4.0, 1: 4.8})}))
    summarize.main(["paired", point("defaults.json", {0: 4.2, 1: 5.0}, evaluator=summarize.EVALUATOR_DEFAULTS), str(old)])
    out = json.loads(capsys.readouterr().out)
    assert out["a_over_b"]["prompts"] == 2 and "conditional_per_position" not in out  # neither point has them
    other = point("other.json", {0: 4.0, 1: 4.8}, evaluator={**evaluator, "eval_prompts": 2})
    for argv, said in ((["paired", muon, other], "evaluated differently"),
                       (["paired", muon, str(tmp_path / "gone.json")], "cannot read"),
                       (["paired", muon, point("disjoint.json", {7: 4.0, 8: 4.1})], "fewer than 2")):
        with pytest.raises(SystemExit, match=said) as e:
            summarize.main(argv)
        assert "\n" not in str(e.value)
    for argv in (["--help"], ["paired", "--help"]):  # its help renders (a bare % in it once broke it)
        with pytest.raises(SystemExit, match="0"):
            summarize.main(argv)


def test_settings_pairs_each_setting_with_the_base_names_it_by_its_folder_and_plots(tmp_path, capsys):
    """A sweep's table in one call: every setting against the base on the prompts both decoded, named by the
    sweep folder its point sits in; a setting evaluated differently ends the call in one line, not a wrong row."""
    evaluator = {"eval_prompts": 4, "eval_new_tokens": 96, "draft_tokens": 7}

    def point(name, lengths, **extra):
        path = tmp_path / "sweep" / name / "curve" / "ours-v512" / "step-0001000.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"step": 1000, "evaluator": evaluator, **report(lengths), **extra}))
        return str(path)

    base = point("muon_2e-3_lm-head-target-frozen", {0: 4.0, 1: 5.0, 2: 3.0, 3: 4.0})
    better = point("muon_2e-3_teacher-temperature-1.0", {0: 4.4, 1: 5.5, 2: 3.3, 3: 4.4})
    worse = point("muon_1e-3", {0: 3.6, 1: 4.5, 2: 2.7, 3: 3.6, 9: 8.0})  # prompt 9: not the base's, not counted
    png = tmp_path / "settings.png"
    summarize.main(["settings", base, better, worse, "--png", str(png)])
    table = json.loads(capsys.readouterr().out)
    assert table["base"]["setting"] == "muon_2e-3_lm-head-target-frozen" and table["base"]["mean_acceptance_length"] == 4.0
    assert [(r["setting"], r["over_base"]["ratio"], r["over_base"]["ci95"], r["over_base"]["prompts"])
            for r in table["settings"]] == [("muon_2e-3_teacher-temperature-1.0", 1.1, [1.1, 1.1], 4),
                                            ("muon_1e-3", 0.9, [0.9, 0.9], 4)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and table["png"] == str(png)
    other = point("adamw_5e-4", {0: 4.0, 1: 4.8}, evaluator={**evaluator, "eval_prompts": 2})
    with pytest.raises(SystemExit, match="evaluated differently") as e:
        summarize.main(["settings", base, better, other])
    assert "\n" not in str(e.value)
    assert summarize.setting_name("/tmp/pts/curve/ours-v512/step-0001000.json") == "pts"  # the race's own point


@pytest.mark.parametrize(("status", "finished"), [
    ({"ours_v512": "done in 80.1s", "curve": "done in 50.2s"}, True),
    ({"ours_v512": "done earlier", "curve": "done in 1.0s"}, True),  # resumed: the training was of this recipe
    # a training of another recipe kept without --retrain is not this setting's
    ({"ours_v512": "done earlier with lr 0.001 (now 0.002) (--retrain trains it again)", "curve": "done in 1.0s"}, False),
    ({"ours_v512": "failed: train stopped (exit 124)", "curve": "done in 1.0s"}, False),
    ({"ours_v512": "done in 80.1s", "curve": "skipped: 40s left, needs ~75s"}, False),
    ({"ours_v512": "done in 80.1s"}, False),  # its point not evaluated in this run
    ({"curve": "done in 1.0s"}, False),  # a run that did not train ours says nothing of it
])
def test_a_setting_is_finished_only_when_ours_trained_at_its_recipe_and_its_point_was_evaluated(tmp_path, status,
                                                                                                finished):
    report = tmp_path / "quality_race.json"
    report.write_text(json.dumps({"status": status}))
    assert summarize.ours_finished(report) is finished
