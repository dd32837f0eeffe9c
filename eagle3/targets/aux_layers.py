"""The one source of truth for EAGLE-3 aux layer ids and every conversion of them.

Convention (vLLM's, ours): id k is the *input* to decoder layer k (0-based), which is HF
``output_hidden_states[k]`` (index 0 is the embedding output). vLLM takes these ids as they
are; id ``num_hidden_layers`` (L) is the last layer's output before the final norm.

SGLang 0.5.23 converts an explicit id list per model family before it captures the input of
each resulting layer (``set_eagle3_layers_to_capture`` in ``srt/models/*.py``):

- Llama-style (``llama.py``, ``mistral.py``, ``qwen2.py``, ``qwen3.py``): adds 1 to every id,
  so SGLang id i is vLLM id i+1.
- DeepseekV2/V3 (``deepseek_v2.py``) and KimiK25 (``kimi_k25.py`` delegates to its language
  model): adds 1 only when the first id is 1, otherwise takes the ids as given. vLLM ids whose
  first is 1 cannot be expressed for this family at all.

Copying a list between the engines' conventions is silently off by one and acceptance
collapses, so every conversion goes through this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FINAL_SLOT = -1  # an id no layer matches: vLLM's extraction leaves it for the final-hidden plugin


@dataclass(frozen=True)
class Family:
    """A target model family as the serving engines treat its aux ids."""

    name: str
    model_types: frozenset[str]  # HF model_type of the config or its text_config
    sglang_rule: str  # SGLang's conversion of explicit ids, in words
    vllm_final_id_since: tuple[int, int, int]  # first vLLM that captures id L for the family


LLAMA_STYLE = Family(
    "Llama", frozenset({"llama", "mistral", "qwen2", "qwen3"}),
    "adds 1 to every id (its ids mean \"output of layer i\")",
    (0, 22, 1),  # LlamaModel / Qwen2Model: _maybe_add_hidden_state(idx + 1) after every layer
)
DEEPSEEK_STYLE = Family(
    "DeepseekV2", frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k25"}),
    "adds 1 only when the first id is 1, and otherwise takes the ids as given (input of layer i)",
    (0, 25, 0),  # DeepseekV2Model: `if self.end_layer in self.aux_hidden_state_layers` since 0.25.0
)
FAMILIES = (LLAMA_STYLE, DEEPSEEK_STYLE)


def target_family(config: Any) -> Family | None:
    """The family of a target config (its ``model_type``, or its ``text_config``'s), or None."""
    text = getattr(config, "text_config", None)
    types = [getattr(config, "model_type", None), getattr(text, "model_type", None) if text is not None else None]
    for family in FAMILIES:
        if any(t in family.model_types for t in types):
            return family
    return None


def family_names() -> str:
    return "; ".join(f"{f.name} ({', '.join(sorted(f.model_types))})" for f in FAMILIES)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default for EAGLE-3: (2, L//2, L-3); Kimi-K2.5 (L=61) gives [2, 30, 58].

    Targets too shallow for three distinct ids that way (L < 8, the tiny test targets) get
    [2, max(L//2, 3), L-1] (L=6: [2, 3, 5]), ids every family lets both engines serve; a
    4-layer target gets [1, 2, 3], which SGLang's DeepseekV2 rule cannot express. The ids are
    always written explicitly into the export, so no engine falls back to its own default.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and ids == sorted(ids):
        return ids
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 decoder layers for EAGLE-3, got {num_layers}")
    if num_layers == 4:
        return [1, 2, 3]
    return [2, max(num_layers // 2, 3), num_layers - 1]


def resolve_aux_layer_ids(configured: Sequence[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured is not None else default_aux_layer_ids(num_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} out of range for a target with {num_layers} layers (0..{num_layers - 1})")
    return ids


def hf_hidden_state_index(layer_id: int) -> int:
    """Index into HF ``output_hidden_states`` for a vLLM-convention aux layer id."""
    return layer_id


def sglang_captures(sglang_ids: Sequence[int], family: Family) -> list[int]:
    """The layers (vLLM ids) SGLang 0.5.23 captures for ``eagle_config`` ids of a target of ``family``."""
    ids = [int(i) for i in sglang_ids]
    if family is DEEPSEEK_STYLE and not (ids and ids[0] == 1):
        return ids
    return [i + 1 for i in ids]


def to_sglang(ids: Sequence[int], family: Family | None) -> list[int]:
    """vLLM ids -> the ``eagle_config`` ids that make SGLang capture the same layers.

    ValueError (one line) when SGLang cannot express them for the family, or the family's
    rule is not known."""
    ids = [int(i) for i in ids]
    if family is None:
        raise ValueError(f"SGLang's aux id rule is known for the families {family_names()} only")
    if family is DEEPSEEK_STYLE:
        if ids and ids[0] == 1:
            raise ValueError(f"aux layer ids {ids} start at 1, which SGLang cannot express for a {family.name} "
                             f"target (it {family.sglang_rule})")
        out = ids
    else:
        out = [i - 1 for i in ids]
    assert sglang_captures(out, family) == ids
    return out


def vllm_captures_final(family: Family, vllm_version: tuple[int, int, int]) -> bool:
    """Does this vLLM capture id L (the last layer's output, before the final norm) for the family?"""
    return vllm_version >= family.vllm_final_id_since


def vllm_extract_ids(aux_ids: Sequence[int], num_layers: int, final_by_id: bool) -> list[int]:
    """The ids ``extract_hidden_states`` is asked for: the aux ids, then the final hidden state,
    as id L (vLLM captures it, before the norm) or as :data:`FINAL_SLOT` (the plugin fills it)."""
    return [*(int(i) for i in aux_ids), num_layers if final_by_id else FINAL_SLOT]
