"""Capture a target's aux and final hidden states with hooks, not output_hidden_states.

``output_hidden_states=True`` keeps all L+1 states alive (62 x [B, T, 7168] for Kimi);
hooks keep only the three aux inputs and the final norm's output. Aux id k is the
input of decoder layer k (vLLM's convention, == HF ``hidden_states[k]``), so the hook is
a forward *pre*-hook on layer k. The final hidden state is the output of the final
norm (== HF ``hidden_states[-1]``). Extract runs only the decoder stack (``model.model``),
so the lm_head over the whole vocab is never computed; evaluate runs the full model
with the same hooks to also get logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagle3.errors import StageError


@dataclass
class DecoderStack:
    base: nn.Module  # runs embed -> layers -> final norm (HF ``model.model``)
    layers: nn.ModuleList
    norm: nn.Module


def find_decoder_stack(model: nn.Module, num_layers: int) -> DecoderStack:
    """The decoder layers (a ModuleList of ``num_layers``), their owner, and its final norm.

    Found by structure rather than by class, so wrappers (multimodal Kimi-K2.5,
    remote-code models) work as long as they keep the usual ``layers`` + ``norm`` pair.
    """
    candidates = []
    for name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        norm = getattr(module, "norm", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers and isinstance(norm, nn.Module):
            candidates.append((name.count("."), name, module))
    if not candidates:
        raise StageError(f"cannot find {num_layers} decoder layers with a final norm in {type(model).__name__}")
    _, _, base = min(candidates, key=lambda c: (c[0], c[1]))
    return DecoderStack(base, base.layers, base.norm)


class HiddenCapture:
    """Hooks that record the aux layers' inputs and the final norm's output of one forward.

    Use as a context manager; after each forward, :meth:`pop` returns
    (aux list of 3 x [B, T, H], final [B, T, H]) on the devices they were computed on.
    ``final_normed=False`` records the final norm's input instead: the last decoder layer's
    output, which is what vLLM's hidden-states connector hands out (speculators' data format).
    """

    def __init__(self, stack: DecoderStack, aux_layer_ids: list[int], final_normed: bool = True) -> None:
        self.stack, self.aux_layer_ids, self.final_normed = stack, list(aux_layer_ids), final_normed
        self._aux: dict[int, torch.Tensor] = {}
        self._final: torch.Tensor | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "HiddenCapture":
        for k in self.aux_layer_ids:
            self._handles.append(self.stack.layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True))
        if self.final_normed:
            self._handles.append(self.stack.norm.register_forward_hook(self._norm_hook))
        else:
            self._handles.append(self.stack.norm.register_forward_pre_hook(self._norm_input_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, k: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self._aux[k] = hidden.detach()

        return hook

    def _norm_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._final = (output[0] if isinstance(output, tuple) else output).detach()

    def _norm_input_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._final = (args[0] if args else kwargs["hidden_states"]).detach()

    def pop(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        missing = [k for k in self.aux_layer_ids if k not in self._aux]
        if missing or self._final is None:
            raise StageError(f"hidden-state hooks did not fire (aux layers {missing}, final norm "
                             f"{'ok' if self._final is not None else 'missing'}): unexpected target structure")
        aux = [self._aux.pop(k) for k in self.aux_layer_ids]
        final, self._final = self._final, None
        return aux, final

    @torch.inference_mode()
    def run_stack(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Forward the decoder stack only (no lm_head) on right-padded ``input_ids`` [B, T].

        No attention mask on purpose: with right padding and causal attention, real
        tokens never attend to the padding after them, and without a mask SDPA keeps
        its fused causal kernel. Padded rows' states are garbage and dropped by the caller.
        """
        self.stack.base(input_ids=input_ids, use_cache=False)
        return self.pop()
