"""A vLLM general plugin: the final hidden state as the last extracted "layer".

Registered as a ``vllm.general_plugins`` entry point (vLLM loads those in every process it
starts, TP workers included), and inert unless ``EAGLE3_VLLM_FINAL_HIDDEN=1`` (set by
:func:`eagle3.extract.vllm_engine.open_llm`), so serving is never touched. When active,
it hooks the target model once vLLM has set its aux layers for ``extract_hidden_states``:
the model's forward returns ``(hidden_states, aux_hidden_states)``, hidden_states being
the output of the final norm, and the hook appends it to the aux list, filling the
id-list slot :data:`eagle3.extract.vllm_engine.FINAL_SLOT` that no layer captures. Relies
on vLLM 0.22.1's ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs``.
"""

from __future__ import annotations

import os
from typing import Any

from eagle3.extract.vllm_engine import FINAL_HIDDEN_ENV


def append_final_hidden(module: Any, args: Any, output: Any) -> Any:
    """Forward hook: ``(h, [aux...])`` -> ``(h, [aux..., h])``; any other output unchanged."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], list):
        hidden, aux = output
        return hidden, [*aux, hidden]
    return output


def register() -> None:
    if os.environ.get(FINAL_HIDDEN_ENV) != "1":
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs
    if getattr(original, "_eagle3_final_hidden", False):
        return

    def setup(self: Any) -> None:
        original(self)
        spec = self.speculative_config
        if spec is not None and spec.uses_extract_hidden_states():
            self.get_model().register_forward_hook(append_final_hidden)

    setup._eagle3_final_hidden = True  # type: ignore[attr-defined]
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = setup
