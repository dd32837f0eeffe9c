"""Named test doubles of vLLM's hidden-state extraction, one profile per release they were written from.

Read from the wheels' source of vLLM 0.22.1, 0.26.0 and 0.34.0 (the oldest supported, the one
that runs on torch 2.11, the newest); what differs between them is a :class:`VllmRelease`:

- ``vllm.LLM`` (``entrypoints/llm.py``): the same named parameters in all three, the rest go to
  ``EngineArgs``. ``dtype="auto"`` (or none) is ``_resolve_auto_dtype`` on an Ampere+ GPU: the
  config's dtype, float32 downcast to bfloat16 (``config/model.py``).
- The target's aux capture (``model_executor/models/llama.py``, ``deepseek_v2.py``): Llama-style
  ``_maybe_add_hidden_state`` appends id 0 (the embedding) and id k+1 after layer k, so id L
  is the last layer's output before the final norm, in every release. DeepseekV2Model appends
  ``hidden_states + residual`` before layer k for ids k < L (id 0: ``residual`` is None and the
  sum raises), and id ``end_layer`` after the last layer only from 0.25.0.
- The runner that runs ``extract_hidden_states`` (``config/vllm.py`` ``use_v2_model_runner``):
  ``VLLM_USE_V2_MODEL_RUNNER`` when set; otherwise V1 up to 0.28 (V2 lists the method as
  unsupported) and V2 from 0.29. V1 (``v1/worker/gpu_model_runner.py``, gone in 0.34) sets the
  aux layers in ``_setup_eagle3_aux_hidden_state_outputs`` and its
  ``ExtractHiddenStatesProposer`` copies ``torch.stack(aux, 1)`` into a [T, len(ids), H]
  buffer; V2's ``ExtractHiddenStatesSpeculator`` raises "Expected N auxiliary hidden states,
  got M"; 0.22.1's V2 ``init_speculator`` knows no such method.
- vLLM loads every ``vllm.general_plugins`` entry point in its processes and calls it without
  a ``try`` (``plugins/__init__.py``): so does this double, with this package's own.
- ``ExampleHiddenStatesConnector`` writes ``{shared_storage_path}/{req_id}.safetensors``
  (``hidden_states`` [T, len(ids), H] in the model dtype, ``token_ids`` int64 [T]) and a
  ``.lock`` beside it, and returns ``{"hidden_states_path": ...}`` as the output's
  ``kv_transfer_params``. 0.22.1 saves the prompt's tokens; from 0.24 the request's
  ``kv_transfer_params["include_output_tokens"]`` saves all its tokens but the last.

The states are the real tiny target's (transformers, hooks), taken where vLLM takes them.
"""

from __future__ import annotations

import json
import os
import sys
import types
import uuid
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# LLM.__init__'s named parameters (0.22.1 and 0.34.0 alike) used here, plus the EngineArgs fields
# the engines pass through **kwargs.
LLM_PARAMS = {"model", "trust_remote_code", "tensor_parallel_size", "dtype", "gpu_memory_utilization",
              "enforce_eager", "seed", "quantization", "hf_overrides"}
ENGINE_ARGS = {"max_model_len", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
               "speculative_config", "kv_transfer_config", "disable_log_stats"}
DEEPSEEK_STYLE = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k25"}


@dataclass(frozen=True)
class VllmRelease:
    version: str
    v1_runner: bool  # v1/worker/gpu_model_runner.py exists
    v2_runs_extract: bool  # Model Runner V2 supports extract_hidden_states and is the default for it
    deepseek_final_id: bool  # DeepseekV2Model appends id end_layer (after the last layer, before the norm)
    include_output_tokens: bool  # the connector honours kv_transfer_params["include_output_tokens"]
    full_vocab_d2t: bool  # llama_eagle3 keeps draft_id_to_target_id (and loads a d2t) at a full draft vocab


RELEASES = {
    "0.22.1": VllmRelease("0.22.1", v1_runner=True, v2_runs_extract=False, deepseek_final_id=False,
                          include_output_tokens=False, full_vocab_d2t=True),
    "0.26.0": VllmRelease("0.26.0", v1_runner=True, v2_runs_extract=False, deepseek_final_id=True,
                          include_output_tokens=True, full_vocab_d2t=True),
    "0.34.0": VllmRelease("0.34.0", v1_runner=False, v2_runs_extract=True, deepseek_final_id=True,
                          include_output_tokens=True, full_vocab_d2t=False),
}


def auto_dtype(config: dict[str, Any]) -> torch.dtype:
    """vLLM's ``dtype="auto"`` on an Ampere+ GPU: the config's dtype, float32 downcast to bfloat16."""
    own = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return torch.float16 if own == "float16" else torch.bfloat16


class TargetModelDouble(torch.nn.Module):
    """The target as vLLM's model file runs it: ``set_aux_hidden_state_layers`` and a forward that
    returns ``(normed hidden, aux list)`` when aux layers are set, collected where vLLM collects them."""

    def __init__(self, model: torch.nn.Module, release: VllmRelease) -> None:
        super().__init__()
        from eagle3.targets.capture import find_decoder_stack
        from eagle3.targets.load import num_layers

        self.model, self.release = model, release
        self.num_layers = num_layers(model.config)
        self.stack = find_decoder_stack(model, self.num_layers)
        self.deepseek = model.config.model_type in DEEPSEEK_STYLE
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.aux_hidden_state_layers = tuple(layers)

    def captured_ids(self) -> list[int]:
        """The ids this model file appends, in the order it appends them (layer order)."""
        last = self.num_layers if not self.deepseek or self.release.deepseek_final_id else None
        if self.deepseek and 0 in self.aux_hidden_state_layers:
            raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")  # residual is None
        return [k for k in range(self.num_layers + 1) if k in self.aux_hidden_state_layers and (k < self.num_layers or k == last)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> Any:
        inputs: dict[int, torch.Tensor] = {}
        handles = [layer.register_forward_pre_hook(
            lambda m, a, kw, k=k: inputs.__setitem__(k, (a[0] if a else kw["hidden_states"])[0]), with_kwargs=True)
            for k, layer in enumerate(self.stack.layers)]
        handles.append(self.stack.norm.register_forward_pre_hook(
            lambda m, a, kw: inputs.__setitem__(self.num_layers, (a[0] if a else kw["hidden_states"])[0]),
            with_kwargs=True))
        normed: list[torch.Tensor] = []
        handles.append(self.stack.norm.register_forward_hook(lambda m, a, out: normed.append(out[0])))
        try:
            self.stack.base(input_ids=input_ids[None], use_cache=False)
        finally:
            for h in handles:
                h.remove()
        aux = [inputs[k] for k in self.captured_ids()]
        return (normed[0], aux) if aux else normed[0]


class GPUModelRunnerV1Double:
    """Model Runner V1 (0.22.1 ``gpu_model_runner.py`` + ``v1/spec_decode/extract_hidden_states.py``)
    for ``extract_hidden_states``; a fresh subclass per engine, so a plugin's patch stays with it."""

    def __init__(self, model: TargetModelDouble, speculative_config: "SpeculativeConfigDouble") -> None:
        self.model, self.speculative_config = model, speculative_config
        self.use_aux_hidden_state_outputs = True
        self._setup_eagle3_aux_hidden_state_outputs()

    def get_model(self) -> TargetModelDouble:
        return self.model

    def _setup_eagle3_aux_hidden_state_outputs(self) -> None:
        if self.use_aux_hidden_state_outputs:
            self.model.set_aux_hidden_state_layers(tuple(self.speculative_config.layer_ids))

    def execute(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, len(ids), H]: what the proposer hands the cache-only layer."""
        output = self.model(input_ids)
        if not isinstance(output, tuple):
            raise ValueError("aux_hidden_states are required when using `extract_hidden_states`")
        _, aux = output
        n, h = len(self.speculative_config.layer_ids), aux[0].shape[-1]
        buffer = torch.zeros(input_ids.numel(), n, h, dtype=aux[0].dtype)
        buffer[: input_ids.numel()] = torch.stack(aux, dim=1)  # a count mismatch fails here, as in vLLM
        return buffer


class ModelRunnerV2Double:
    """Model Runner V2 with ``ExtractHiddenStatesSpeculator`` (0.34 ``v1/worker/gpu/spec_decode``)."""

    def __init__(self, model: TargetModelDouble, speculative_config: "SpeculativeConfigDouble") -> None:
        self.model, self.speculative_config = model, speculative_config
        model.set_aux_hidden_state_layers(tuple(speculative_config.layer_ids))  # eagle3_utils, top-level ids

    def execute(self, input_ids: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids)
        aux = output[1] if isinstance(output, tuple) else None
        if aux is None:
            raise ValueError("aux_hidden_states are required when using extract_hidden_states")
        if len(aux) != len(self.speculative_config.layer_ids):
            raise ValueError(f"Expected {len(self.speculative_config.layer_ids)} auxiliary hidden states, got {len(aux)}")
        return torch.stack(aux, dim=1)


@dataclass
class SpeculativeConfigDouble:
    method: str
    layer_ids: list[int]

    def uses_extract_hidden_states(self) -> bool:
        return self.method == "extract_hidden_states"


@dataclass
class SamplingParamsDouble:
    max_tokens: int = 16
    temperature: float = 1.0
    extra_args: dict[str, Any] | None = None


@dataclass
class CompletionOutputDouble:
    token_ids: list[int]


@dataclass
class RequestOutputDouble:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    outputs: list[CompletionOutputDouble] = field(default_factory=list)


def fake_vllm_modules(runner_cls: type | None) -> dict[str, types.ModuleType]:
    """``vllm`` package modules a plugin imports; ``vllm.v1.worker.gpu_model_runner`` only where V1 exists."""
    mods = {name: types.ModuleType(name) for name in ("vllm", "vllm.v1", "vllm.v1.worker")}
    if runner_cls is not None:
        runner = types.ModuleType("vllm.v1.worker.gpu_model_runner")
        runner.GPUModelRunner = runner_cls  # type: ignore[attr-defined]
        mods[runner.__name__] = runner
    return mods


def load_general_plugins() -> None:
    """vLLM's ``load_general_plugins``: every entry point loaded (in a try), then called (no try)."""
    plugins = []
    for ep in entry_points(group="vllm.general_plugins"):
        try:
            plugins.append(ep.load())
        except Exception:  # noqa: BLE001 (vLLM logs a failed load and goes on)
            continue
    for plugin in plugins:
        plugin()


class VllmLLMDouble:
    """``vllm.LLM`` of :attr:`release` with ``extract_hidden_states`` and the hidden-states connector."""

    release: VllmRelease = RELEASES["0.22.1"]
    instances: list["VllmLLMDouble"] = []

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - LLM_PARAMS - ENGINE_ARGS
        assert not unknown, f"vllm.LLM ({self.release.version}) takes no {sorted(unknown)}"
        assert Path(kwargs["model"]).is_dir()
        assert kwargs["enable_chunked_prefill"] is False, "extract_hidden_states requires chunked prefill off"
        assert kwargs["enable_prefix_caching"] is False, "a cached prefix is not recomputed: its states go missing"
        assert kwargs["max_num_batched_tokens"] >= kwargs["max_model_len"], "a prompt must fit one step"
        spec = kwargs["speculative_config"]
        assert set(spec) == {"method", "num_speculative_tokens", "draft_model_config"}
        assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
        ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        if not ids:
            raise ValueError("eagle_aux_hidden_state_layer_ids must be set in the draft model config for "
                             "extract_hidden_states method")
        assert all(isinstance(i, int) for i in ids)
        kv = kwargs["kv_transfer_config"]
        assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
        self.storage = Path(kv["kv_connector_extra_config"]["shared_storage_path"])
        assert self.storage.is_dir()
        self.kwargs, self.layer_ids = kwargs, list(ids)
        self.model = TargetModelDouble(self._load_target(kwargs["model"], kwargs.get("dtype", "auto")), self.release)
        self.runner = self._runner(SpeculativeConfigDouble(spec["method"], list(ids)))
        self.calls = 0
        VllmLLMDouble.instances.append(self)

    def _load_target(self, model: str, dtype: str) -> torch.nn.Module:
        from eagle3.targets.load import load_target_model
        from eagle3.settings.target import TargetSettings

        config = json.loads((Path(model) / "config.json").read_text())
        self.dtype = auto_dtype(config) if dtype == "auto" else getattr(torch, dtype)
        return load_target_model(TargetSettings(model=model), "cpu", self.dtype)

    def _runner(self, spec: SpeculativeConfigDouble) -> Any:
        """The runner vLLM picks, built after the general plugins ran (as in a worker process)."""
        env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if not self.release.v1_runner and env is not None and env != "1":  # platforms/interface.py validate_environ
            raise ValueError(f"VLLM_USE_V2_MODEL_RUNNER={env} is no longer supported: Model Runner V1 has been "
                             "removed. Unset this variable.")
        v2 = self.release.v2_runs_extract if env is None else env.lower() in ("1", "true")
        v1_cls = type("GPUModelRunner", (GPUModelRunnerV1Double,), {}) if self.release.v1_runner else None
        fakes = fake_vllm_modules(v1_cls)
        saved = {name: sys.modules.get(name) for name in fakes}
        sys.modules.update(fakes)
        try:
            load_general_plugins()
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
        if v2 and not self.release.v2_runs_extract:
            raise NotImplementedError(f"{spec.method} is not supported yet.")  # 0.22.1's init_speculator
        if v2:
            return ModelRunnerV2Double(self.model, spec)
        assert v1_cls is not None, f"vLLM {self.release.version} has no Model Runner V1"
        return v1_cls(self.model, spec)

    def generate(self, prompts: list[dict[str, list[int]]], sampling_params: SamplingParamsDouble, *,
                 use_tqdm: bool = True) -> list[RequestOutputDouble]:
        assert sampling_params.max_tokens == 1
        self.calls += 1
        return [self._request(p, sampling_params) for p in prompts]

    def _request(self, prompt: dict[str, list[int]], params: SamplingParamsDouble) -> RequestOutputDouble:
        assert set(prompt) == {"prompt_token_ids"}  # a TokensPrompt
        ids = prompt["prompt_token_ids"]
        states = self.runner.execute(torch.tensor(ids))  # [T, len(ids), H]
        kv_params = (params.extra_args or {}).get("kv_transfer_params") or {}
        token_ids = list(ids)
        if self.release.include_output_tokens and kv_params.get("include_output_tokens"):
            token_ids = (ids + [0])[:-1]  # all tokens but the last (max_tokens=1: the prompt)
        req = uuid.uuid4().hex
        path = self.storage / f"{req}.safetensors"
        (self.storage / f"{req}.safetensors.lock").touch()
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(token_ids, dtype=torch.int64)},
                  str(path))
        return RequestOutputDouble(req, ids, {"hidden_states_path": str(path)}, [CompletionOutputDouble([0])])
