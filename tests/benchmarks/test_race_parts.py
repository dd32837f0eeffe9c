"""The race's parts (benchmarks/quality/): intervals and refusals, result files, flags, speculators' adapters."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from benchmarks.quality import files, race, speculators_side, summary, target


def report(lengths: dict[int, float], steps: int = 50) -> dict:
    return {"per_prompt": [{"id": i, "verify_steps": steps, "mean_acceptance_length": m} for i, m in lengths.items()],
            "acceptance_rate_per_position": {"conditional": [0.9, 0.8, 0.7]}}


def test_the_paired_interval_cancels_what_the_prompts_share():
    rng = random.Random(1)
    base = {i: 1.5 + rng.random() for i in range(32)}
    same_shift = summary.ratio_ci(report({i: m * 1.02 for i, m in base.items()}), report(base))
    assert same_shift["ratio"] == 1.02 and same_shift["ci95"] == [1.02, 1.02]  # prompt difficulty cancels
    noisy = summary.ratio_ci(report({i: m + rng.uniform(-0.3, 0.3) for i, m in base.items()}), report(base))
    lo, hi = noisy["ci95"]
    assert lo < noisy["ratio"] < hi and hi - lo > 0.02 and noisy["prompts"] == 32
    ours, theirs = report({1: 2.0, 2: 2.0, 3: 9.0}), report({1: 1.0, 2: 1.0})  # only prompts both decoded count
    assert summary.ratio_ci(ours, theirs)["ratio"] == 2.0 and summary.ratio_ci(report({1: 2.0}), theirs) is None


def test_prompts_weigh_by_their_verify_steps_and_the_interval_is_seeded():
    rep = {"per_prompt": [{"id": 0, "verify_steps": 30, "mean_acceptance_length": 1.0},
                          {"id": 1, "verify_steps": 10, "mean_acceptance_length": 3.0}]}
    assert summary.acceptance_ci(rep)["mean_acceptance_length"] == 1.5  # (30 + 30) / 40
    rng = random.Random(2)
    wide = report({i: 1.5 + rng.random() for i in range(40)})
    ci = summary.acceptance_ci(wide)
    assert ci == summary.acceptance_ci(wide) and ci["ci95"][0] < ci["mean_acceptance_length"] < ci["ci95"][1]
    assert summary.steady([{"tokens_per_s": r} for r in (10.0, 100.0, 102.0, 30.0, 101.0)]) == 100.5  # start left out


def _results(ours_steps: int = 40, spec_steps: int = 40, vllm: bool = False) -> dict:
    ours = {"final_step": ours_steps, "steady_tokens_per_s": 300.0, "peak_memory_gib": 4.0, "draft_vocab_coverage": 0.9}
    spec = {"final_step": spec_steps, "steady_tokens_per_s": 100.0, "peak_memory_gib": None}
    counts = {"mean_acceptance_length": 3.0, "acceptance_rate_per_position": {"conditional": [0.9]},
              "verify_steps": 10, "vllm_version": "0.22.1", "dtype": "bfloat16"}
    return {"target": {}, "ours": ours, "ours_report": report({i: 3.3 for i in range(4)}), "spec_train": spec,
            "spec_eval": report({i: 3.0 for i in range(4)}), "vllm_ours": {**counts, "mean_acceptance_length": 3.3}
            if vllm else None, "vllm_spec": counts if vllm else None}


def test_ratios_only_where_both_sides_trained_the_steps_asked_and_were_measured(tmp_path):
    states = dict.fromkeys(("ours", "spec_train", "spec_eval"), "done") | dict.fromkeys(
        ("vllm_ours", "vllm_spec"), "not run: vLLM is not installed")
    out = summary.summarize(_results(), states, {"train_steps": 40})
    assert out["acceptance_ratio"]["ratio"] == 1.1 and out["throughput_ratio"] == 3.0
    assert out["peak_memory_ratio"] == "not reported: CUDA peak memory not measured for speculators"
    assert out["vllm"]["eagle3ctl"] == "not measured: vLLM is not installed"
    assert out["vllm"]["acceptance_ratio"] == "not reported: vLLM acceptance not measured for eagle3ctl and speculators"
    short = summary.summarize(_results(spec_steps=0), states, {"train_steps": 40})
    assert short["acceptance_ratio"] == "not reported: speculators trained 0 of 40 steps"
    assert short["speculators"]["acceptance"]["mean_acceptance_length"] == 3.0  # its own figure stays
    recipe = {"train_steps": 40, "draft_vocab": 256, "draft_tokens": 3}
    measured = summary.summarize(_results(vllm=True), dict.fromkeys(states, "done"), recipe)
    assert measured["vllm"]["acceptance_ratio"] == 1.1 and measured["vllm"]["speculators"]["dtype"] == "bfloat16"
    summary.plot(measured, tmp_path / "race.png")  # both engines, both sides, the ratios in its title
    assert (tmp_path / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = summary.summarize({**_results(), "spec_train": None, "spec_eval": None},
                                {**states, "spec_train": "not run: speculators is missing"}, {"train_steps": 40})
    assert missing["speculators"] == "not run: speculators is missing"
    assert missing["acceptance_ratio"].startswith("not reported: spec_train not run: speculators is missing")


def test_a_result_file_is_whole_or_absent_and_valid_while_what_it_names_is_there(tmp_path):
    path, made = tmp_path / "ours.json", tmp_path / "export"
    made.mkdir()
    files.write_json(path, {"paths": [str(made)]})
    assert files.read_result(path) == {"paths": [str(made)]}
    made.rmdir()
    assert files.read_result(path) is None  # what it names is gone: the step runs again
    path.write_text('{"paths": [')  # half a file, as no write_json leaves one
    assert files.read_result(path) is None

    class Unwritable:
        def __str__(self):
            raise RuntimeError("not serializable")

    files.write_json(path, {"kept": 1})
    with pytest.raises(RuntimeError):
        files.write_json(path, {"bad": Unwritable()})
    assert json.loads(path.read_text()) == {"kept": 1} and os.listdir(tmp_path) == ["ours.json"]


def test_bad_flags_are_one_line_and_another_recipe_needs_another_folder(tmp_path, capsys):
    base = ["--work", str(tmp_path / "w"), "--scale", "test"]
    for flags, said in ((["--ours", "teacher_temperature=0"], "train.teacher_temperature: Input should be greater "),
                        (["--ours", "no_such_setting=1"], "train.no_such_setting: Extra inputs are not permitted"),
                        (["--ours", "lm_head"], "write SETTING=VALUE"),
                        (["--train-steps", "many"], "argument --train-steps: invalid int value: 'many'")):
        with pytest.raises(SystemExit) as e:
            race.parse_args(base + flags)
        assert e.value.code == 2 and said in capsys.readouterr().err.strip().splitlines()[-1]
    work, recipe = race.parse_args(base + ["--ours", "loss_tokens=assistant"])
    assert recipe["ours"]["loss_tokens"] == "assistant" and recipe["train_steps"] == race.TEST["train_steps"]
    race.start(work, recipe)
    assert race.start(work, recipe).recipe == recipe  # the same recipe resumes
    with pytest.raises(SystemExit, match=r"another recipe \(train_steps 40 -> 41\); give another --work"):
        race.start(work, {**recipe, "train_steps": 41})
    config = race.pipeline_config(race.Race(work, recipe))
    assert (config["train"]["loss_tokens"], config["train"]["max_steps"], config["target"]["dtype"]) == (
        "assistant", 40, "bfloat16")


def test_the_targets_code_chats_are_a_prefix_and_its_continuation(tmp_path):
    for i in range(60):
        (tmp_path / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(20)))
    train, held = target.code_files(tmp_path)
    assert len(held) == 1 and len(train) == 59 and target.code_files(tmp_path) == (train, held)  # the same split
    chats = target.code_chats(train, 100, seed=0, max_chars=200)
    assert chats == target.code_chats(train, 100, seed=0, max_chars=200) and len(chats) == 100
    texts = [p.read_text() for p in train]
    for user, answer in chats:  # the code as it stands in a training file: the prefix, a line end, what follows
        assert user["role"] == "user" and answer["role"] == "assistant" and len(user["content"]) <= 200
        assert any(user["content"] + "\n" + answer["content"] in text for text in texts)
    with pytest.raises(SystemExit, match="the corpus gives 0 code chats, 3 needed"):
        target.code_chats([tmp_path / "none.py"], 3, seed=0, max_chars=200)


def test_hidden_states_are_the_aux_inputs_and_the_final_norms_input(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle3.generate.tokenized import from_lists

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 900, (n,), generator=g).tolist() for n in (13, 5, 9)]
    samples = from_lists([(i, r, [1] * len(r)) for i, r in enumerate(rows)])
    assert speculators_side.write_hidden_states(model, samples, [1, 3, 4], tmp_path, batch_tokens=20) == 27
    for i, row in enumerate(rows):
        saved = load_file(str(tmp_path / f"hs_{i}.safetensors"))
        assert saved["token_ids"].tolist() == row and saved["hidden_states"].shape == (len(row), 4, 64)
        with torch.inference_mode():
            ref = model(torch.tensor([row]), output_hidden_states=True).hidden_states  # L+1 x [1, T, H]
            torch.testing.assert_close(model.model.norm(saved["hidden_states"][:, 3].float()), ref[-1][0],
                                       atol=0.05, rtol=0.05)  # bf16 stored
        for j, k in enumerate([1, 3, 4]):
            torch.testing.assert_close(saved["hidden_states"][:, j], ref[k][0].to(torch.bfloat16), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("draft_vocab", [256, None])  # None: the target's whole vocab, no mapping kept
def test_a_speculators_checkpoint_exports_as_the_export_stage_writes(tmp_path, tiny_llama_dir, draft_vocab):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from eagle3.drafter.adapter import expected_shapes
    from eagle3.drafter.model import DrafterConfig
    from eagle3.export.stage import check_export, tensor_meta
    from eagle3.export.vllm_config import build_vllm_config
    from eagle3.vocab.mapping import build_vocab_mapping

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    dcfg = DrafterConfig(hidden_size=64, target_hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=vocab, draft_vocab_size=draft_vocab or vocab,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, aux_layer_ids=[1, 3, 4])
    torch.manual_seed(0)
    ours = {k: torch.randn(shape) for k, shape in expected_shapes(dcfg).items()}
    theirs = {k.replace("midlayer.", "layers.0."): v for k, v in ours.items()} | {"embed_tokens.weight": torch.zeros(1)}
    if draft_vocab:
        theirs |= dict(zip(("d2t", "t2d"), build_vocab_mapping(torch.arange(vocab, 0, -1), draft_vocab)))
    ckpt = tmp_path / "spec" / "3"
    ckpt.mkdir(parents=True)
    save_file(theirs, str(ckpt / "model.safetensors"))
    (ckpt / "training_state.json").write_text(json.dumps({"epoch": 3, "local_step": 0, "global_step": 40}))
    layer = {k: getattr(dcfg, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                                           "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")}
    (ckpt / "config.json").write_text(json.dumps({"transformer_layer_config": {**layer, "rope_theta": 10000.0}}))
    assert speculators_side.checkpoints(tmp_path / "spec") == [(40, ckpt)]
    out = tmp_path / "export"
    result = speculators_side.export_ours(ckpt, str(tiny_llama_dir), [1, 3, 4], out)
    assert result["ignored_tensors"] == ["embed_tokens.weight"]
    config = json.loads((out / "config.json").read_text())
    assert config == build_vllm_config(dcfg, [1, 3, 4])
    assert check_export(config, tensor_meta(out / "model.safetensors"), [1, 3, 4]) == []
    exported = load_file(str(out / "model.safetensors"))
    for k, v in ours.items():
        assert torch.equal(exported[k], v.to(torch.bfloat16)), k
    if not draft_vocab:  # the full vocab: no mapping, as vLLM 0.34 requires
        assert "d2t" not in exported and "t2d" not in exported
