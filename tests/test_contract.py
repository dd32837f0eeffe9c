"""Each stage's verdict for a run, in DAG order: the one walk preflight, status, the scheduler,
reuse and verify read."""

from __future__ import annotations

from eagle3.contract import COMPLETE, INCOMPLETE, NOT_STARTED, judge_run, key_change
from eagle3.stages import ORDER
from tests.committed import path_of
from tests.pipeline.test_scheduler import run as run_with_doubles
from tests.pipeline.test_scheduler import setup as config_and_store


def _committed_run(tmp_path):
    cfg, store = config_and_store(tmp_path)
    _, result, _ = run_with_doubles(cfg, store, tmp_path)
    assert result.ok, result.failures
    return cfg, store


def test_a_finished_run_is_complete_stage_by_stage_for_the_keys_its_manifests_hold(tmp_path):
    cfg, store = _committed_run(tmp_path)
    verdicts = judge_run(cfg, store)
    assert list(verdicts) == list(ORDER)
    for name, v in verdicts.items():
        assert v.state == COMPLETE and v.reason == "" and not v.waits_for, (name, v.reason)
        m = v.manifest.manifest
        assert v.input_key == m.input_key
        assert {u: up.digest for u, up in v.upstream.items()} == m.upstream


def test_a_changed_setting_makes_its_stage_stale_and_the_stages_after_it_wait(tmp_path):
    cfg, store = _committed_run(tmp_path)
    changed = cfg.model_copy(update={"vocab": cfg.vocab.model_copy(update={"draft_vocab_size": 7})})
    verdicts = judge_run(changed, store)
    vocab = verdicts["vocab"]
    assert vocab.state == INCOMPLETE and vocab.check.stale and vocab.check.damage == []
    assert vocab.reason == vocab.check.stale and vocab.input_key != vocab.manifest.manifest.input_key
    change = key_change(changed, store, vocab)
    assert change.upstream == [] and change.settings == ["vocab.draft_vocab_size: 32000 -> 7"]
    assert change.describe("{} changed", "settings: {}", "code") == "settings: vocab.draft_vocab_size: 32000 -> 7"
    assert verdicts["generate"].complete and verdicts["extract"].complete
    assert verdicts["train"].waits_for == ("vocab",) and verdicts["train"].reason == "waits for vocab"
    assert verdicts["train"].state == INCOMPLETE and verdicts["train"].input_key is None
    assert verdicts["export"].waits_for == ("train", "vocab")
    # judged without keys (no config to judge by), the committed output is complete as it stands
    assert all(v.complete for v in judge_run(changed, store, keys=False).values())


def test_a_forced_stage_is_not_complete_and_until_walks_only_what_a_stage_reads(tmp_path):
    cfg, store = _committed_run(tmp_path)
    verdicts = judge_run(cfg, store, force=("extract",))
    assert verdicts["extract"].state == INCOMPLETE and verdicts["extract"].reason == "--force"
    assert verdicts["vocab"].complete and verdicts["train"].waits_for == ("extract",)
    assert list(judge_run(cfg, store, until="train")) == ["generate", "vocab", "extract", "train"]
    assert list(judge_run(cfg, store, until="vocab")) == ["generate", "vocab"]


def test_damage_names_the_object_and_a_run_never_started_is_not_started(tmp_path):
    cfg, store = _committed_run(tmp_path)
    path_of(store, cfg.run_id, "extract", "index.json").unlink()
    extract = judge_run(cfg, store)["extract"]
    assert extract.state == INCOMPLETE and extract.reason.startswith("missing object ")
    assert extract.reason.endswith("/index.json") and extract.check.damage == extract.check.problems
    fresh = judge_run(cfg.model_copy(update={"run_id": "t2"}), store)
    assert [v.state for v in fresh.values()] == [NOT_STARTED] * len(ORDER)
    assert fresh["generate"].waits_for == () and fresh["vocab"].waits_for == ("generate",)


def test_settle_is_asked_only_where_the_upstream_is_complete_and_what_it_returns_counts(tmp_path):
    cfg, store = _committed_run(tmp_path)
    changed = cfg.model_copy(update={"vocab": cfg.vocab.model_copy(update={"draft_vocab_size": 7})})
    asked = []

    def settle(v):
        asked.append(v.stage)
        return v.manifest  # taken as the stage's: what comes after it is judged against it

    verdicts = judge_run(changed, store, settle=settle)
    assert asked == ["vocab"]
    assert all(v.complete for v in verdicts.values())
    assert verdicts["train"].upstream["vocab"].digest == verdicts["vocab"].manifest.digest
    asked.clear()
    verdicts = judge_run(changed, store, settle=lambda v: asked.append(v.stage))
    assert asked == ["vocab"] and not verdicts["vocab"].complete and verdicts["train"].waits_for == ("vocab",)
