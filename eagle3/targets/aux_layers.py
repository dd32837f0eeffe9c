"""The one source of truth for EAGLE-3 aux layer ids.

Convention (vLLM's): id k is the *input* to decoder layer k (0-based), which is
HF ``output_hidden_states[k]`` (index 0 is the embedding output). SGLang reads an
explicit id i as the *output* of layer i, i.e. vLLM id k == SGLang id k-1. Copying a
list between the two conventions is silently off by one, so every conversion goes
through this module.
"""

from __future__ import annotations

from collections.abc import Sequence


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default for EAGLE-3: (2, L//2, L-3); Kimi-K2.5 (L=61) gives [2, 30, 58].

    Targets too shallow for three distinct ids that way (L < 8, the tiny test
    targets) get [1, L//2, L-1] instead; the ids are always written explicitly into
    the export, so the serving engine never falls back to its own default.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and ids == sorted(ids):
        return ids
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 decoder layers for EAGLE-3, got {num_layers}")
    return [1, num_layers // 2, num_layers - 1]


def resolve_aux_layer_ids(configured: Sequence[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured is not None else default_aux_layer_ids(num_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} out of range for a target with {num_layers} layers (0..{num_layers - 1})")
    return ids


def hf_hidden_state_index(layer_id: int) -> int:
    """Index into HF ``output_hidden_states`` for a vLLM-convention aux layer id."""
    return layer_id


def to_sglang(ids: Sequence[int]) -> list[int]:
    """vLLM ids (input of layer k) → SGLang ids (output of layer k-1)."""
    return [i - 1 for i in ids]


def from_sglang(ids: Sequence[int]) -> list[int]:
    return [i + 1 for i in ids]
