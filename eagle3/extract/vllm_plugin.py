"""A vLLM general plugin: the final hidden state as the last extracted "layer", for the vLLM
releases whose DeepseekV2/V3 models do not capture id ``num_hidden_layers`` (0.22.1-0.24.x).

Registered as a ``vllm.general_plugins`` entry point, so every vLLM process of every release
loads it (engine core and TP workers; ``vllm serve`` too) and calls :func:`register` without a
``try``. It must therefore never fail: it imports nothing beyond the standard library and
:mod:`eagle3.vllm_version` until it acts, and it acts only when ``EAGLE3_VLLM_FINAL_HIDDEN=1``
(set by :func:`eagle3.extract.vllm_engine.open_llm` on the plugin path alone) and the installed
vLLM is one of :data:`PLUGIN_RELEASES`. Then it hooks the target model once vLLM's Model
Runner V1 has set its aux layers for ``extract_hidden_states``
(``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs``, present in every release up to
0.33): the model's forward returns ``(hidden_states, aux_hidden_states)``, hidden_states being
the output of the final norm, and the hook appends it to the aux list, filling the id-list slot
:data:`eagle3.targets.aux_layers.FINAL_SLOT` that no layer captures.
"""

from __future__ import annotations

import os
import sys
from typing import Any

FINAL_HIDDEN_ENV = "EAGLE3_VLLM_FINAL_HIDDEN"
# Releases that need it (DeepseekV2Model captures id L from 0.25.0) and run extract_hidden_states
# on Model Runner V1 (V2 takes it over at 0.29.0; 0.34 has no V1).
PLUGIN_RELEASES = ((0, 22, 1), (0, 25, 0))  # [from, below)


def append_final_hidden(module: Any, args: Any, output: Any) -> Any:
    """Forward hook: ``(h, [aux...])`` -> ``(h, [aux..., h])``; any other output unchanged."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], list):
        hidden, aux = output
        return hidden, [*aux, hidden]
    return output


def plugin_applies() -> bool:
    """Asked for (the env) and on a release that needs it; a word on stderr when asked for in vain."""
    if os.environ.get(FINAL_HIDDEN_ENV) != "1":
        return False
    from eagle3.vllm_version import installed_vllm, parse_version

    text = installed_vllm() or "none"
    try:
        version = parse_version(text)
    except ValueError:
        version = None
    if version is None or not PLUGIN_RELEASES[0] <= version < PLUGIN_RELEASES[1]:
        print(f"eagle3: {FINAL_HIDDEN_ENV}=1 is ignored on vLLM {text}: it captures the final hidden state itself",
              file=sys.stderr, flush=True)
        return False
    return True


def register() -> None:
    if not plugin_applies():
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
