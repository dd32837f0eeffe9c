import json
import multiprocessing
import re
from contextlib import contextmanager

import pytest
import torch

from eagle3.context import run_stage
from eagle3.errors import StageError
from eagle3.evaluate import stage as evaluate_stage
from eagle3.evaluate.workers import WorkerTraceback
from eagle3.manifest import StageOutput, verify_stage
from eagle3.store import open_store
from tests.extract.pipeline import (commit_generate, commit_untrained_train, commit_vocab, pipeline_config,
                                    random_samples)
from tests.committed import attempt_key, key_of


def test_evaluate_stage_reports_acceptance_of_the_export(tmp_path, tiny_target_dir):
    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("llama"), **{
        "generate.max_samples": 4, "evaluate.num_prompts": 2, "evaluate.max_new_tokens": 10,
        "evaluate.num_draft_tokens": 3, "evaluate.check_greedy": 2})
    commit_generate(cfg, random_samples(4), tmp_path)
    run_stage(cfg, "extract")
    counts = torch.arange(1024, 0, -1)
    commit_vocab(cfg, counts, 128, tmp_path)
    commit_untrained_train(cfg, 128, tmp_path)
    run_stage(cfg, "export")
    stats = run_stage(cfg, "evaluate")
    store = open_store(cfg.store.uri)
    report = json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json')))
    assert report["held_out"] is True and "did not use" in report["prompt_source"]
    assert report["num_prompts"] == 2 and report["num_draft_tokens"] == 3
    assert report["greedy_check"] == {"prompts_checked": 2, "prompts_matching": 2, "all_match": True}
    assert 1 <= report["mean_acceptance_length"] <= 4
    assert report["draft_tokens_proposed"] == 3 * report["verify_steps"]
    assert len(report["acceptance_rate_per_position"]["conditional"]) == 3
    assert report["aux_layer_ids"] == json.loads(store.get_bytes(key_of(store, 't', "extract", 'index.json')))["aux_layer_ids"]
    assert sum(p["tokens_generated"] for p in report["per_prompt"]) == report["tokens_generated"]
    assert stats["mean_acceptance_length"] == report["mean_acceptance_length"]
    assert verify_stage(store, "t", "evaluate", deep=True, content_check=evaluate_stage.deep_check).complete


def test_fallback_to_training_prompts_is_said_in_the_report(tmp_path):
    from eagle3.evaluate.prompts import held_out_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(5)))
    cfg = pipeline_config(tmp_path / "store", tmp_path, **{"generate.prompts": str(prompts), "evaluate.num_prompts": 2})
    held = held_out_prompts(cfg)
    assert held.held_out is False and "NOT held out" in held.source
    assert [p.sample_id for p in held.prompts] == [3, 4]
    cfg = pipeline_config(tmp_path / "store", tmp_path, **{"generate.prompts": str(prompts), "generate.max_samples": 3,
                                                           "evaluate.num_prompts": 5})
    held = held_out_prompts(cfg)
    assert held.held_out is True and len(held.prompts) == 2
    used = {0, 1, 2, 3, 4} - {p.sample_id for p in held.prompts}
    assert len(used) == 3


RUN = {"generate.max_samples": 4, "evaluate.num_prompts": 4, "evaluate.max_new_tokens": 10,
       "evaluate.num_draft_tokens": 3, "evaluate.check_greedy": 3}


def exported_run(tmp_path, target_dir, **overrides):
    """A run whose generate, extract, vocab, train (untrained drafter) and export are committed."""
    cfg = pipeline_config(tmp_path / "store", target_dir, **{**RUN, **overrides})
    commit_generate(cfg, random_samples(4), tmp_path)
    run_stage(cfg, "extract")
    commit_vocab(cfg, torch.arange(1024, 0, -1), 128, tmp_path)
    commit_untrained_train(cfg, 128, tmp_path)
    run_stage(cfg, "export")
    return cfg


def without_timing(report):
    return {k: v for k, v in report.items() if k != "decode_s"}


@pytest.mark.slow  # ~15 s on 2 busy cores: each spawned worker imports torch + transformers
def test_workers_give_the_report_of_one_process(tmp_path, tiny_target_dir):
    target_dir = tiny_target_dir("llama")
    cfg = exported_run(tmp_path, target_dir)
    store = open_store(cfg.store.uri)
    run_stage(cfg, "evaluate")
    one = json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json')))
    two_workers = pipeline_config(tmp_path / "store", target_dir, **{**RUN, "evaluate.workers": 2})
    assert run_stage(two_workers, "evaluate") is None  # workers changes how, not what: same input key
    run_stage(two_workers, "evaluate", force=True)
    two = json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json')))
    print(f"decode_s: 1 process {one['decode_s']}, 2 workers {two['decode_s']}")
    assert without_timing(two) == without_timing(one)
    assert [p["id"] for p in two["per_prompt"]] == [p["id"] for p in one["per_prompt"]]
    assert ["matches_greedy" in p for p in two["per_prompt"]] == [True, True, True, False]
    assert two["greedy_check"] == {"prompts_checked": 3, "prompts_matching": 3, "all_match": True}


class Killed(Exception):
    pass


def killed_at_the_third_prompt(real_put):
    """StageOutput.put_json that dies when the third prompt's result is to be journaled."""

    def put_json(self, name, obj, journal=True):
        if name == evaluate_stage.prompt_key(2):
            raise Killed()
        return real_put(self, name, obj, journal)

    return put_json


def counting_decoder(decoded: list[int]):
    """open_hf_decoder's real decoder, noting in ``decoded`` which prompts it is given."""
    real_open = evaluate_stage.open_hf_decoder

    @contextmanager
    def counting(*args):
        with real_open(*args) as decode:
            yield lambda positions, items: decoded.extend(i for i, _, _ in items) or decode(positions, items)

    return counting


def killed_evaluation(tmp_path, tiny_target_dir, monkeypatch):
    """A run whose evaluate was killed after prompts 0 and 1 were journaled."""
    cfg = exported_run(tmp_path, tiny_target_dir("llama"), **{"evaluate.batch_size": 2})
    with monkeypatch.context() as m:
        m.setattr(StageOutput, "put_json", killed_at_the_third_prompt(StageOutput.put_json))
        with pytest.raises(Killed):
            run_stage(cfg, "evaluate")
    assert not verify_stage(open_store(cfg.store.uri), "t", "evaluate").complete
    return cfg


def test_a_killed_evaluation_decodes_only_the_prompts_left(tmp_path, tiny_target_dir, monkeypatch):
    cfg = killed_evaluation(tmp_path, tiny_target_dir, monkeypatch)
    store = open_store(cfg.store.uri)
    real_put, real_open = StageOutput.put_json, evaluate_stage.open_hf_decoder
    decoded: list[int] = []
    monkeypatch.setattr(evaluate_stage, "open_hf_decoder", counting_decoder(decoded))
    stats = run_stage(cfg, "evaluate")
    assert decoded == [2, 3] and stats["prompts_resumed"] == 2
    resumed = json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json')))
    assert verify_stage(store, "t", "evaluate", deep=True, content_check=evaluate_stage.deep_check).complete
    monkeypatch.setattr(evaluate_stage, "open_hf_decoder", real_open)
    run_stage(cfg, "evaluate", force=True)  # a clean attempt, from scratch
    clean = json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json')))
    assert without_timing(resumed) == without_timing(clean)

    # a forced rerun that is killed costs nothing: the committed report stays, verified
    monkeypatch.setattr(StageOutput, "put_json", killed_at_the_third_prompt(real_put))
    with pytest.raises(Killed):
        run_stage(cfg, "evaluate", force=True)
    v = verify_stage(store, "t", "evaluate", deep=True, content_check=evaluate_stage.deep_check)
    assert v.complete and json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json'))) == clean


def test_a_prompt_result_edited_in_place_before_resume_is_decoded_again(tmp_path, tiny_target_dir, monkeypatch, capfd):
    cfg = killed_evaluation(tmp_path, tiny_target_dir, monkeypatch)
    store = open_store(cfg.store.uri)
    path = store.local_path(attempt_key(store, "t", "evaluate", evaluate_stage.prompt_key(0)))
    text = path.read_text()
    i = re.compile(r'"accept_lengths": \[\s*').search(text).end()  # the first prompt step's accepted length
    path.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])  # same size, still a valid result
    capfd.readouterr()
    decoded: list[int] = []
    monkeypatch.setattr(evaluate_stage, "open_hf_decoder", counting_decoder(decoded))
    stats = run_stage(cfg, "evaluate")
    said = [ln for ln in capfd.readouterr().err.splitlines() if "discarded" in ln]
    assert len(said) == 1 and said[0].startswith(
        f"evaluate: discarded {evaluate_stage.prompt_key(0)} of the interrupted attempt (corrupted")
    assert decoded == [0, 2, 3] and stats["prompts_resumed"] == 1
    def report() -> dict:
        return json.loads(store.get_bytes(key_of(store, "t", "evaluate", "report.json")))

    resumed = report()
    monkeypatch.undo()
    run_stage(cfg, "evaluate", force=True)  # a clean attempt, from scratch
    assert without_timing(resumed) == without_timing(report())


def commit_export_with_d2t_outside_the_target_vocab(cfg, tmp_path):
    """Re-commit export with every draft id mapped beyond the target's vocab (a corrupted drafter)."""
    from safetensors.torch import load_file, save_file

    store = open_store(cfg.store.uri)
    config = json.loads(store.get_bytes(key_of(store, 't', "export", 'config.json')))
    tensors = load_file(str(store.local_path(key_of(store, 't', "export", 'model.safetensors'))))
    tensors["d2t"] = tensors["d2t"] + config["vocab_size"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    out = StageOutput(store, cfg.run_id, "export", "corrupted-export", {})
    out.begin()
    out.put_json("config.json", config)
    out.put_file("model.safetensors", tmp_path / "model.safetensors")
    out.put_bytes("SERVING.md", store.get_bytes(key_of(store, 't', "export", 'SERVING.md')))
    out.commit({})


def test_a_failing_worker_fails_the_stage_in_one_line(tmp_path, tiny_target_dir):
    cfg = exported_run(tmp_path, tiny_target_dir("llama"), **{"evaluate.workers": 2})
    commit_export_with_d2t_outside_the_target_vocab(cfg, tmp_path)
    with pytest.raises(StageError) as e:
        run_stage(cfg, "evaluate")
    assert re.fullmatch(r"evaluate worker [01] failed on prompt [0-3]: IndexError: index out of range in self",
                        str(e.value)), str(e.value)
    assert isinstance(e.value.__cause__, WorkerTraceback) and "Traceback" in str(e.value.__cause__)
    assert not multiprocessing.active_children()  # every worker was stopped


def test_batches_give_the_report_of_one_at_a_time(tmp_path, tiny_target_dir):
    target_dir = tiny_target_dir("llama")
    cfg = exported_run(tmp_path, target_dir, **{"generate.max_samples": 3, "evaluate.num_prompts": 5})
    store = open_store(cfg.store.uri)
    run_stage(cfg, "evaluate")
    one = json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json')))
    batched = pipeline_config(tmp_path / "store", target_dir, **{**RUN, "generate.max_samples": 3,
                                                                  "evaluate.num_prompts": 5, "evaluate.batch_size": 4})
    assert run_stage(batched, "evaluate") is None  # batch_size changes how, not what: same input key
    run_stage(batched, "evaluate", force=True)
    four = json.loads(store.get_bytes(key_of(store, 't', "evaluate", 'report.json')))
    print(f"decode_s: one at a time {one['decode_s']}, batches of 4 {four['decode_s']}")
    assert one["num_prompts"] == 5  # a batch of 4 and a batch of 1
    assert without_timing(four) == without_timing(one)
    assert four["greedy_check"] == {"prompts_checked": 3, "prompts_matching": 3, "all_match": True}
