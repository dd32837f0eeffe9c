import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3.context import run_stage
from eagle3.export import stage as export_stage
from eagle3.export.vllm_config import build_vllm_config, drafter_config_from_export
from eagle3.targets.aux_layers import DEEPSEEK_STYLE, LLAMA_STYLE, to_sglang
from eagle3.drafter.model import DrafterConfig
from eagle3.manifest import verify_stage
from eagle3.store import open_store
from tests.extract.pipeline import (commit_generate, commit_untrained_train, commit_vocab, pipeline_config,
                                    random_samples)
from tests.committed import key_of

# What vLLM's EAGLE-3 loader does with each checkpoint tensor, encoded from
# vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights and
# LlamaModel.load_weights): "t2d" is skipped; "d2t" becomes draft_id_to_target_id;
# names without "lm_head" get a "model." prefix; "midlayer." becomes "layers.0.";
# q/k/v_proj stack into qkv_proj (input 2*hidden for layer 0); gate/up into gate_up_proj;
# fc is ReplicatedLinear(3*target_hidden_size -> hidden_size); lm_head has draft_vocab_size
# rows; embed_tokens is optional (the target's is shared when absent).
VLLM_PARAMS = {
    "model.fc.weight": lambda c: (c["hidden_size"], 3 * c["target_hidden_size"]),
    "model.layers.0.input_layernorm.weight": lambda c: (c["hidden_size"],),
    "model.layers.0.hidden_norm.weight": lambda c: (c["hidden_size"],),
    "model.layers.0.self_attn.qkv_proj.weight[q]": lambda c: (c["num_attention_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "model.layers.0.self_attn.qkv_proj.weight[k]": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "model.layers.0.self_attn.qkv_proj.weight[v]": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "model.layers.0.self_attn.o_proj.weight": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
    "model.layers.0.post_attention_layernorm.weight": lambda c: (c["hidden_size"],),
    "model.layers.0.mlp.gate_up_proj.weight[0]": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "model.layers.0.mlp.gate_up_proj.weight[1]": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "model.layers.0.mlp.down_proj.weight": lambda c: (c["hidden_size"], c["intermediate_size"]),
    "model.norm.weight": lambda c: (c["hidden_size"],),
    "lm_head.weight": lambda c: (c["draft_vocab_size"], c["hidden_size"]),
    "draft_id_to_target_id": lambda c: (c["draft_vocab_size"],),
}


def vllm_param(name: str) -> str | None:
    """The vLLM parameter a checkpoint tensor loads into (None: skipped), as llama_eagle3.py maps it."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for part, stacked, shard in ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
                                 (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)):
        if part in name:
            return f"{name.replace(part, stacked)}[{shard}]"
    return name


def _drafter_cfg(**kw) -> DrafterConfig:
    base = dict(hidden_size=64, target_hidden_size=96, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=1024, draft_vocab_size=200, aux_layer_ids=[2, 30, 58])
    return DrafterConfig(**{**base, **kw})


def test_config_has_every_field_vllm_and_sglang_read():
    c = build_vllm_config(_drafter_cfg(), [2, 30, 58], to_sglang([2, 30, 58], LLAMA_STYLE), LLAMA_STYLE)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False and c["hidden_act"] == "silu"
    assert (c["vocab_size"], c["draft_vocab_size"], c["target_hidden_size"]) == (1024, 200, 96)
    assert (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == \
        (64, 128, 4, 2, 16)
    assert c["torch_dtype"] == "bfloat16" and c["norm_before_residual"] is False
    # vLLM reads the top-level ids first; SGLang reads eagle_config's and, for a Llama target, adds 1.
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert c["eagle_config"]["use_aux_hidden_state"] is True
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert [i + 1 for i in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == c["eagle_aux_hidden_state_layer_ids"]
    assert json.loads(json.dumps(c)) == c
    assert drafter_config_from_export(c) == _drafter_cfg()
    # Kimi-K2.5 (DeepseekV2 family): SGLang takes [2, 30, 58] as given; for vLLM only, no inner ids at all.
    kimi = build_vllm_config(_drafter_cfg(), [2, 30, 58], to_sglang([2, 30, 58], DEEPSEEK_STYLE), DEEPSEEK_STYLE)
    assert kimi["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert build_vllm_config(_drafter_cfg(), [2, 30, 58])["eagle_config"] == {"use_aux_hidden_state": True}


@pytest.fixture
def exported(tmp_path, tiny_target_dir):
    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("deepseek"), **{"extract.shard_tokens": 200})
    commit_generate(cfg, random_samples(4), tmp_path)
    run_stage(cfg, "extract")
    counts = torch.zeros(1024, dtype=torch.int64)
    counts[:700] = torch.arange(700, 0, -1)
    commit_vocab(cfg, counts, 256, tmp_path)
    drafter = commit_untrained_train(cfg, 256, tmp_path)
    stats = run_stage(cfg, "export")
    return cfg, drafter, stats


def test_export_round_trip_matches_vllm_loader(exported):
    cfg, drafter, stats = exported
    store = open_store(cfg.store.uri)
    config = json.loads(store.get_bytes(key_of(store, 't', "export", 'config.json')))
    tensors = load_file(str(store.local_path(key_of(store, 't', "export", 'model.safetensors'))))
    index = json.loads(store.get_bytes(key_of(store, 't', "extract", 'index.json')))
    extract_stats = verify_stage(store, "t", "extract").manifest.manifest.stats
    assert config["eagle_aux_hidden_state_layer_ids"] == index["aux_layer_ids"] == extract_stats["aux_layer_ids"]
    assert stats["aux_layer_ids"] == extract_stats["aux_layer_ids"]
    loaded = {}
    for name, t in tensors.items():
        param = vllm_param(name)
        if param is None:
            assert name == "t2d" and t.dtype == torch.bool and t.shape == (config["vocab_size"],)
            continue
        assert param in VLLM_PARAMS, f"vLLM has no parameter for checkpoint tensor {name}"
        assert tuple(t.shape) == VLLM_PARAMS[param](config), name
        assert t.dtype == (torch.int64 if param == "draft_id_to_target_id" else torch.bfloat16), name
        loaded[param] = t
    assert set(loaded) == set(VLLM_PARAMS)
    # Weights are the trained drafter's (rounded to bf16); d2t is the vocab stage's offset table.
    from eagle3.drafter.adapter import exportable_state_dict

    sd = exportable_state_dict(drafter)
    for name in sd:
        torch.testing.assert_close(tensors[name], sd[name].to(torch.bfloat16))
    target_ids = torch.arange(256) + tensors["d2t"]
    assert tensors["t2d"][target_ids].all() and int(tensors["t2d"].sum()) == 256
    # The tiny DeepseekV3 target: SGLang's DeepseekV2 rule takes the default ids [2, 3, 5] as given.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == index["aux_layer_ids"] == [2, 3, 5]
    assert (stats["target_family"], stats["sglang_aux_layer_ids"]) == ("DeepseekV2", [2, 3, 5])
    note = store.get_bytes(key_of(store, 't', "export", 'SERVING.md')).decode()
    assert "eagle_aux_hidden_state_layer_ids` = [2, 3, 5]" in note and "takes the ids as given" in note
    # The dtype extract ran the target in, and the depth the drafter was trained to draft (train.ttt_steps).
    assert index["target_dtype"] == stats["target_dtype"] == "float32" and cfg.train.ttt_steps == 7
    assert "vllm serve TARGET --dtype float32" in note and '"num_speculative_tokens": 7}' in note
    assert "--model-path TARGET --dtype float32" in note and "--speculative-num-steps 7" in note
    assert verify_stage(store, "t", "export", deep=True, content_check=export_stage.deep_check).complete


def test_export_loads_back_as_the_same_drafter(exported):
    from eagle3.drafter.adapter import load_drafter

    cfg, drafter, _ = exported
    store = open_store(cfg.store.uri)
    config = json.loads(store.get_bytes(key_of(store, 't', "export", 'config.json')))
    back = load_drafter(store.local_path(key_of(store, 't', "export", 'model.safetensors')), drafter.embed_tokens.weight,
                        drafter_config_from_export(config))
    assert back.config == drafter.config


def test_check_export_names_problems():
    c = build_vllm_config(_drafter_cfg(), [2, 30, 58], [1, 29, 57], LLAMA_STYLE)
    meta = {k: (s, "bfloat16") for k, s in __import__("eagle3.drafter.adapter", fromlist=["x"]).expected_shapes(_drafter_cfg()).items()}
    meta["d2t"], meta["t2d"] = ((200,), "int64"), ((1024,), "bool")
    assert export_stage.check_export(c, meta, [2, 30, 58], LLAMA_STYLE) == []
    assert any("extract's" in p for p in export_stage.check_export(c, meta, [1, 30, 58]))
    bad = {**c, "eagle_config": {**c["eagle_config"], "eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    assert any("make SGLang capture [3, 31, 59] on a Llama-family target, not [2, 30, 58]" in p
               for p in export_stage.check_export(bad, meta, None, LLAMA_STYLE))
    assert export_stage.check_export(bad, meta, None, DEEPSEEK_STYLE) == []  # as given: right for Kimi
    assert any("make SGLang capture None" in p for p in
               export_stage.check_export(build_vllm_config(_drafter_cfg(), [2, 30, 58]), meta, None, LLAMA_STYLE))
    meta2 = {**meta, "fc.weight": ((64, 100), "bfloat16")}
    assert any("fc.weight" in p for p in export_stage.check_export(c, meta2, None))
    full = build_vllm_config(_drafter_cfg(draft_vocab_size=1024), [2, 30, 58])
    full_meta = {**meta, "lm_head.weight": ((1024, 64), "bfloat16")}
    assert export_stage.check_export(full, full_meta, None) == ["model.safetensors: d2t, t2d in a full-vocab export "
                                                                "(vLLM refuses them)"]
    del full_meta["d2t"], full_meta["t2d"]
    assert export_stage.check_export(full, full_meta, None) == []


def _kimi_like_target(max_positions=262144):
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    text = DeepseekV3Config(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, intermediate_size=18432,
                            vocab_size=163840, max_position_embeddings=max_positions,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    return Kimi_K25Config(text_config=text)


def test_drafter_positions_follow_the_target():
    from eagle3.settings.drafter import DrafterSettings

    target = _kimi_like_target()
    config = build_vllm_config(DrafterConfig.from_target(target, DrafterSettings(), 32000, [2, 30, 58]), [2, 30, 58])
    assert config["max_position_embeddings"] == 262144  # was the settings default, 8192
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 50000.0
    assert config["rope_parameters"]["rope_type"] == "default" and config["rope_scaling"] is None  # what we train
    assert config["hidden_size"] == config["target_hidden_size"] == 7168 and config["vocab_size"] == 163840
    mine = DrafterConfig.from_target(target.to_dict(), DrafterSettings(max_position_embeddings=131072, rope_theta=1e6),
                                     32000, [2, 30, 58])
    assert (mine.max_position_embeddings, mine.rope_theta) == (131072, 1e6)


def test_position_limit_problem():
    from eagle3.export.vllm_config import position_limit_problem, target_max_positions

    assert target_max_positions(_kimi_like_target()) == 262144
    assert "vLLM would stop drafting past 8192 tokens" in position_limit_problem(8192, 262144, overridden=False)
    assert position_limit_problem(8192, 262144, overridden=True) is None
    assert position_limit_problem(262144, 262144, overridden=False) is None
    assert position_limit_problem(8192, None, overridden=False) is None


def test_export_refuses_a_drafter_shorter_than_the_target(tmp_path, tiny_target_dir):
    from eagle3.errors import StageError

    short = pipeline_config(tmp_path / "store", tiny_target_dir("deepseek"), **{"drafter.max_position_embeddings": 512})
    commit_generate(short, random_samples(2), tmp_path)
    run_stage(short, "extract")
    commit_vocab(short, torch.arange(1024, 0, -1), 64, tmp_path)
    commit_untrained_train(short, 64, tmp_path)
    plain = pipeline_config(tmp_path / "store", tiny_target_dir("deepseek"))
    with pytest.raises(StageError, match="drafter max_position_embeddings 512 < the target's 4096"):
        run_stage(plain, "export")
    assert run_stage(short, "export")["max_position_embeddings"] == 512  # set on purpose: allowed


def vllm_load_error(tensors: dict, config: dict, release) -> str | None:
    """Eagle3LlamaForCausalLM.load_weights of ``release`` (tests/extract/vllm_double.py): the error its
    weight loader raises for these checkpoint tensors, or None. From 0.30 a full draft vocab builds no
    ``draft_id_to_target_id``; before, the parameter stays (zeros: the identity) when no d2t comes."""
    full = config["draft_vocab_size"] == config["vocab_size"]
    params = set(VLLM_PARAMS) - ({"draft_id_to_target_id"} if full and not release.full_vocab_d2t else set())
    for name in tensors:
        param = vllm_param(name)
        if param is not None and param.split("[")[0] not in {p.split("[")[0] for p in params}:
            return f"There is no module or parameter named '{param}'"
    return None


def _full_vocab_export(tmp_path, tiny_target_dir, **overrides):
    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("deepseek"), **overrides)
    commit_generate(cfg, random_samples(2), tmp_path)
    run_stage(cfg, "extract")
    commit_vocab(cfg, torch.arange(1024, 0, -1), 1024, tmp_path)  # the tiny target's whole vocab
    commit_untrained_train(cfg, 1024, tmp_path)
    return cfg, run_stage(cfg, "export")


def test_a_full_vocab_export_has_no_mapping_and_every_release_loads_it(tmp_path, tiny_target_dir):
    from eagle3.export.directory import read_d2t
    from tests.extract.vllm_double import RELEASES

    cfg, stats = _full_vocab_export(tmp_path, tiny_target_dir)
    store = open_store(cfg.store.uri)
    config = json.loads(store.get_bytes(key_of(store, 't', "export", 'config.json')))
    path = store.local_path(key_of(store, 't', "export", 'model.safetensors'))
    tensors = load_file(str(path))
    assert "d2t" not in tensors and "t2d" not in tensors and stats["vocab_mapping"] == "none (full vocab)"
    assert config["draft_vocab_size"] == config["vocab_size"] == 1024
    assert all(vllm_load_error(tensors, config, r) is None for r in RELEASES.values())
    # What the export wrote before: 0.34 refuses a d2t at a full vocab, 0.22.1 and 0.26.0 take it.
    with_mapping = {**tensors, "d2t": torch.zeros(1024, dtype=torch.int64), "t2d": torch.ones(1024, dtype=torch.bool)}
    assert [v for v, r in RELEASES.items() if vllm_load_error(with_mapping, config, r)] == ["0.34.0"]
    assert torch.equal(read_d2t(path, 1024), torch.zeros(1024, dtype=torch.int64))  # the hf evaluator's identity
    assert verify_stage(store, "t", "export", deep=True, content_check=export_stage.deep_check).complete


def test_export_refuses_ids_sglang_cannot_express_for_the_family(tmp_path, tiny_target_dir):
    from eagle3.errors import StageError

    with pytest.raises(StageError, match=r"aux layer ids \[1, 3, 5\] start at 1, which SGLang cannot express for a "
                                         r"DeepseekV2 target .*set export.sglang: false"):
        _full_vocab_export(tmp_path / "a", tiny_target_dir, **{"target.aux_layer_ids": [1, 3, 5]})
    cfg, stats = _full_vocab_export(tmp_path / "b", tiny_target_dir,
                                    **{"target.aux_layer_ids": [1, 3, 5], "export.sglang": False})
    store = open_store(cfg.store.uri)
    config = json.loads(store.get_bytes(key_of(store, 't', "export", 'config.json')))
    assert config["eagle_config"] == {"use_aux_hidden_state": True} and stats["sglang_aux_layer_ids"] is None
    assert "for vLLM only" in store.get_bytes(key_of(store, 't', "export", 'SERVING.md')).decode()
    assert verify_stage(store, "t", "export", deep=True, content_check=export_stage.deep_check).complete


def test_a_llama_target_exports_ids_one_less_for_sglang(tmp_path, tiny_target_dir):
    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("llama"), **{"target.aux_layer_ids": [1, 3, 5]})
    commit_generate(cfg, random_samples(2), tmp_path)
    run_stage(cfg, "extract")
    commit_vocab(cfg, torch.arange(1024, 0, -1), 64, tmp_path)
    commit_untrained_train(cfg, 64, tmp_path)
    stats = run_stage(cfg, "export")
    assert (stats["target_family"], stats["sglang_aux_layer_ids"]) == ("Llama", [0, 2, 4])
    store = open_store(cfg.store.uri)
    note = store.get_bytes(key_of(store, 't', "export", 'SERVING.md')).decode()
    assert "eagle_aux_hidden_state_layer_ids` = [0, 2, 4]" in note and "adds 1 to every id" in note
