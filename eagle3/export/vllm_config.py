"""The exported drafter's ``config.json``, as vLLM's and SGLang's EAGLE-3 loaders read it.

What each engine reads (from their source, not guessed):

- vLLM ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``):
  a Llama config with ``num_hidden_layers`` draft layers; ``target_hidden_size`` sizes
  ``fc`` (3 x target hidden -> hidden); ``draft_vocab_size`` sizes ``lm_head``;
  ``eagle_config["use_aux_hidden_state"]``; ``norm_before_residual`` (default False:
  the residual is ``fc``'s output before ``hidden_norm``, which is what our drafter does).
- vLLM's aux ids: the TOP-LEVEL ``eagle_aux_hidden_state_layer_ids`` first, in every release
  (Model Runner V1 ``_get_eagle3_aux_layers_from_config``, 0.22.1-0.33; V2
  ``spec_decode/eagle/eagle3_utils.py``, 0.22.1-0.34). vLLM ids: id k = input of decoder layer k.
- SGLang 0.5.23 (``spec_aux_hidden_state.py``): only ``eagle_config["eagle_aux_hidden_state_layer_ids"]``,
  which the target's ``set_eagle3_layers_to_capture`` converts by the target's family
  (:mod:`eagle3.targets.aux_layers`).

So the top-level key carries the vLLM ids and the ``eagle_config`` key carries ids that make
SGLang capture the same layers for this target's family (``to_sglang``). vLLM never reads the
inner one because the top-level key wins; SGLang captures exactly the layers we trained on.
An export for vLLM only (``export.sglang: false``) writes no inner ids.
"""

from __future__ import annotations

from typing import Any

from eagle3.drafter.model import DrafterConfig
from eagle3.targets.aux_layers import Family

ARCHITECTURE = "LlamaForCausalLMEagle3"


def build_vllm_config(drafter: DrafterConfig, aux_layer_ids: list[int], sglang_ids: list[int] | None = None,
                      family: Family | None = None, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json for an exported EAGLE-3 drafter (pure: values in, dict out).

    ``sglang_ids``: ``eagle_config``'s ids, already converted for the target's ``family``; None
    writes none (an export for vLLM only)."""
    ids = [int(i) for i in aux_layer_ids]
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
    if sglang_ids is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in sglang_ids]
        eagle_config["eagle_aux_hidden_state_layer_ids_convention"] = (
            f"sglang, {family.name}-family target: it {family.sglang_rule}" if family is not None else "sglang")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": drafter.hidden_size,
        "intermediate_size": drafter.intermediate_size,
        "num_attention_heads": drafter.num_attention_heads,
        "num_key_value_heads": drafter.num_key_value_heads,
        "head_dim": drafter.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": drafter.rms_norm_eps,
        "rope_theta": drafter.rope_theta,
        # transformers >= 5 reads RoPE from rope_parameters; older readers use rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": drafter.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": drafter.max_position_embeddings,
        "vocab_size": drafter.vocab_size,
        "draft_vocab_size": drafter.draft_vocab_size,
        "target_hidden_size": drafter.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": eagle_config,
    }


def target_max_positions(config: Any) -> int | None:
    """The target's position limit (a multimodal wrapper's from its ``text_config``)."""
    text = getattr(config, "text_config", None) or config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def position_limit_problem(drafter_max: int, target_max: int | None, overridden: bool) -> str | None:
    """Why a drafter's ``max_position_embeddings`` would cut drafting short, or None.

    vLLM drafts only while a sequence fits min(drafter, target) positions (its drafter
    max_model_len); a drafter below the target stops proposing on long thinking traces.
    A smaller limit set on purpose (``drafter.max_position_embeddings``) is allowed.
    """
    if target_max is None or drafter_max >= target_max or overridden:
        return None
    return (f"drafter max_position_embeddings {drafter_max} < the target's {target_max}: vLLM would stop drafting "
            f"past {drafter_max} tokens; leave drafter.max_position_embeddings unset to follow the target")


def drafter_config_from_export(config: dict[str, Any]) -> DrafterConfig:
    """The inverse of :func:`build_vllm_config`: what evaluate needs to rebuild the drafter."""
    return DrafterConfig.from_dict({**config, "aux_layer_ids": list(config["eagle_aux_hidden_state_layer_ids"])})
