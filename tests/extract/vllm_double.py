"""``VllmLLMDouble``: a named test double of ``vllm.LLM`` (vLLM 0.22.1) for hidden-state extraction.

It takes exactly the constructor arguments the extract engine passes and checks each against
what vLLM 0.22.1 accepts and requires (``vllm/entrypoints/llm.py`` LLM.__init__ and the
EngineArgs fields it forwards; ``config/speculative.py`` for ``extract_hidden_states``;
``example_hidden_states_connector.py`` for the connector), then answers ``generate`` as vLLM
with ExampleHiddenStatesConnector does: one ``{shared_storage_path}/{req_id}.safetensors``
per request with ``hidden_states`` [prompt_len, num_ids, hidden] and ``token_ids``
[prompt_len], a ``.lock`` beside it, and ``kv_transfer_params["hidden_states_path"]``.
The states are the real tiny target's (transformers, hooks), in the slot order the engine
asks for: the aux ids, then the plugin's final (post-norm) hidden state.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# LLM.__init__'s named parameters at 0.22.1 plus the EngineArgs fields the engine passes through **kwargs.
LLM_PARAMS = {"model", "trust_remote_code", "tensor_parallel_size", "dtype", "gpu_memory_utilization",
              "enforce_eager", "seed", "quantization", "hf_overrides"}
ENGINE_ARGS = {"max_model_len", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
               "speculative_config", "kv_transfer_config"}


@dataclass
class SamplingParamsDouble:
    max_tokens: int = 16
    temperature: float = 1.0


@dataclass
class RequestOutputDouble:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]


class VllmLLMDouble:
    instances: list["VllmLLMDouble"] = []

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - LLM_PARAMS - ENGINE_ARGS
        assert not unknown, f"vllm.LLM (0.22.1) takes no {sorted(unknown)}"
        assert Path(kwargs["model"]).is_dir()
        assert kwargs["enable_chunked_prefill"] is False, "extract_hidden_states requires chunked prefill off"
        assert kwargs["enable_prefix_caching"] is False, "a cached prefix is not recomputed: its states go missing"
        assert kwargs["max_num_batched_tokens"] >= kwargs["max_model_len"], "a prompt must fit one step"
        spec = kwargs["speculative_config"]
        assert set(spec) == {"method", "num_speculative_tokens", "draft_model_config"}
        assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
        ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        assert all(isinstance(i, int) for i in ids) and len(ids) == 4 and ids[-1] == -1
        kv = kwargs["kv_transfer_config"]
        assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
        self.storage = Path(kv["kv_connector_extra_config"]["shared_storage_path"])
        assert self.storage.is_dir()
        self.kwargs, self.aux_ids = kwargs, ids[:-1]
        from eagle3.targets.capture import HiddenCapture, find_decoder_stack
        from eagle3.targets.load import load_target_model, num_layers
        from eagle3.settings.target import TargetSettings

        self.model = load_target_model(TargetSettings(model=kwargs["model"]), "cpu", torch.float32)
        self.stack = find_decoder_stack(self.model, num_layers(self.model.config))
        self.capture = HiddenCapture
        self.calls = 0
        VllmLLMDouble.instances.append(self)

    def generate(self, prompts: list[dict[str, list[int]]], sampling_params: SamplingParamsDouble, *,
                 use_tqdm: bool = True) -> list[RequestOutputDouble]:
        assert sampling_params.max_tokens == 1
        self.calls += 1
        outs = []
        with self.capture(self.stack, self.aux_ids) as cap:
            for p in prompts:
                assert set(p) == {"prompt_token_ids"}  # a TokensPrompt
                ids = p["prompt_token_ids"]
                aux, final = cap.run_stack(torch.tensor([ids]))
                states = torch.stack([*[a[0] for a in aux], final[0]], dim=1)  # [T, 4, H]
                req = uuid.uuid4().hex
                path = self.storage / f"{req}.safetensors"
                (self.storage / f"{req}.safetensors.lock").touch()
                save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, str(path))
                outs.append(RequestOutputDouble(req, ids, {"hidden_states_path": str(path)}))
        return outs
