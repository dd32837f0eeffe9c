"""The fit check: parameters counted from the config, bytes per engine, one-line refusals."""

from __future__ import annotations

import pytest
import torch

from eagle3.errors import ConfigError
from eagle3.targets.fit import Gpus, check_fit, fit_problem, parameter_counts, weight_bytes

H200 = Gpus(8, 141 * 10**9)

# Kimi-K2.5's text model as its config.json has it (DeepseekV3 / kimi_k2), and its
# compressed-tensors INT4 (pack-quantized, groups of 32) for everything but the ignore list.
KIMI_TEXT = dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                 num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
                 n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, moe_layer_freq=1,
                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 vocab_size=163840, n_group=1, topk_group=1, topk_method="noaux_tc", max_position_embeddings=262144)
KIMI_IGNORE = (["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:model\\.layers\\.0\\.mlp\\..*"])
KIMI_QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": KIMI_IGNORE,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True, "type": "int"}}}}
KIMI = {"model_type": "kimi_k25", "tie_word_embeddings": False, "text_config": {**KIMI_TEXT, "quantization_config": KIMI_QUANT}}


@pytest.mark.parametrize("arch", ["llama", "deepseek", "kimi"])
def test_counts_equal_the_instantiated_language_model(tiny_target_dir, arch):
    from transformers import AutoConfig

    from eagle3.targets.load import auto_model_class
    from eagle3.settings.target import TargetSettings

    settings = TargetSettings(model=str(tiny_target_dir(arch)))
    config = AutoConfig.from_pretrained(settings.model)
    with torch.device("meta"):
        model = auto_model_class(settings).from_config(config)
    vision = sum(p.numel() for n, p in model.named_parameters() if "vision" in n or "projector" in n)
    assert sum(parameter_counts(config).values()) == sum(p.numel() for p in model.parameters()) - vision


def test_kimi_k25_sizes():
    w = weight_bytes(KIMI)
    assert 1.0e12 < w.params < 1.1e12  # ~1.03T
    assert w.quantized_params / w.params > 0.97  # the routed experts
    assert 0.55e12 < w.vllm < 0.65e12  # ~595 GB as shipped
    assert 2.0e12 < w.hf < 2.2e12  # ~2 TB in bf16


def test_kimi_on_eight_h200_refuses_hf_and_names_vllm():
    w = weight_bytes(KIMI)
    problem = fit_problem(w, "hf", H200, "extract.engine")
    assert "dequantized on load" in problem and "more than 80% of 8 GPUs x 141 GB" in problem
    assert problem.endswith(f"set extract.engine: vllm (vLLM holds it in {w.vllm / 1e9:.0f} GB)")
    assert "\n" not in problem
    assert fit_problem(w, "vllm", H200, "extract.engine") is None
    assert "does not fit vLLM either" in fit_problem(w, "hf", Gpus(2, 80 * 10**9), "extract.engine")
    assert "in vLLM, more than 85%" in fit_problem(w, "vllm", Gpus(2, 80 * 10**9), "extract.engine")


def test_unquantized_and_fp8_checkpoints():
    plain = {**KIMI_TEXT, "tie_word_embeddings": False}
    w = weight_bytes(plain)
    assert w.hf == w.vllm == 2 * w.params and w.method is None
    fp8 = weight_bytes({**plain, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert fp8.hf == fp8.vllm < w.hf * 0.6  # transformers keeps fp8 weights in fp8


def test_check_fit_on_the_stage_config(tiny_target_dir, tmp_path):
    import json

    from eagle3.config import load_config

    cfg = load_config(None, {"target.model": str(tiny_target_dir("kimi")), "extract.engine": "hf"})
    check_fit(cfg, "extract", gpus=H200)  # tiny: fits
    check_fit(cfg, "evaluate")  # this machine, no GPU: host memory
    big = tmp_path / "kimi-k2.5"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({**KIMI, "text_config": {**KIMI["text_config"]}}))
    cfg = load_config(None, {"target.model": str(big), "extract.engine": "hf", "evaluate.engine": "hf"})
    with pytest.raises(ConfigError, match=r"^extract.engine=hf: .*kimi-k2.5: target needs 2\.\d\d TB .* set "
                                          r"extract.engine: vllm"):
        check_fit(cfg, "extract", gpus=H200)
    with pytest.raises(ConfigError, match="set evaluate.engine: vllm"):
        check_fit(cfg, "evaluate", gpus=H200)
    check_fit(load_config(None, {"target.model": str(big), "extract.engine": "vllm"}), "extract", gpus=H200)
    with pytest.raises(ConfigError, match="cannot check that the target fits"):
        check_fit(load_config(None, {"target.model": str(tmp_path / "missing")}), "extract", gpus=H200)
