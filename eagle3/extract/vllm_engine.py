"""extract.engine = vllm: hidden states from the target running in vLLM, converted into our shards.

For targets too big for transformers on the node (Kimi-K2.5: INT4 as shipped), the target
runs in vLLM (0.22.1 to 0.34.x, :mod:`eagle3.vllm_version`; the serve image pins the newest)
with the ``extract_hidden_states`` speculative method and ``ExampleHiddenStatesConnector``.
What vLLM does, read from each release's source:

- ``speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}``
  (``config/speculative.py``; 0.34: ``v1/worker/gpu/spec_decode/extract_hidden_states_config.py``).
  The ids go to the target's ``set_aux_hidden_state_layers`` unchanged: vLLM's convention,
  which is ours. The model appends the captured states in layer order.
- The runner: 0.22.1-0.28.x run the method on Model Runner V1 (V2 lists it as unsupported);
  0.29.0-0.33.x on V2 by default (``ExtractHiddenStatesSpeculator``); 0.34 has only V2.
- The connector writes one file per request, ``{shared_storage_path}/{req_id}.safetensors``
  with ``hidden_states`` [prompt_len, num_ids, hidden] (the model dtype) and ``token_ids``
  [prompt_len] (int64), and a ``.lock`` beside it held exclusively until the write ends. The
  path comes back in ``RequestOutput.kv_transfer_params["hidden_states_path"]``. From 0.24 a
  request's ``kv_transfer_params["include_output_tokens"]`` adds its output tokens (but the
  last); we send none, so the file holds the prompt.
- A whole prompt is saved from one forward step: chunked prefill must be off (the docs say
  so) and prefix caching too (a cached prefix is not recomputed, so its states would be
  missing from the step), and a batch must hold the longest sample.
- MLA targets (DeepseekV2/V3, Kimi-K2.5) need nothing else: the cache-only layer's
  ``HiddenStateCacheSpec`` has no ``cache_dtype_str`` and MLA layers' specs have one, so
  ``MLAAttentionSpec.merge`` (which compares that, not the head shape) refuses to merge them and
  the KV-cache planner keeps the layer's own [len(ids), H] shape (same code in every release).

The final hidden state (after the target's final norm, as the ``hf`` engine stores it):

- Where vLLM captures id L = ``num_hidden_layers`` for the target's family (Llama-style
  models in every supported release, DeepseekV2/V3 and so Kimi-K2.5's text model from 0.25.0;
  :func:`eagle3.targets.aux_layers.vllm_captures_final`), the id list ends with L: the last
  layer's output *before* the final norm. The norm is applied here, as transformers applies
  it, with the weight read from the checkpoint (:class:`FinalNorm`). Nothing in vLLM is patched.
- Otherwise (DeepseekV2/V3 on 0.22.1-0.24.x, which collect ids < L only) the list ends with
  :data:`~eagle3.targets.aux_layers.FINAL_SLOT`, which no layer captures, and
  :mod:`eagle3.extract.vllm_plugin` (a ``vllm.general_plugins`` entry point, active only when
  :data:`FINAL_HIDDEN_ENV` is set and only on those releases) fills it with the model's output
  on Model Runner V1, which those releases run.

Each shard's samples are one ``generate`` call of ``max_tokens=1``; their files are read (under
the lock), checked against the samples' tokens, placed into the shard, and deleted, and the
shard streams to the store as the ``hf`` engine's do. Shards are planned identically, so a
rerun adopts finished shards and extracts only the rest.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.generate.tokenized import TokenizedSamples
from eagle3.errors import StageError
from eagle3.extract.batching import ShardPlan
from eagle3.extract.run import ShardStats, shard_buffers, to_storage
from eagle3.extract.shards import HiddenShard
from eagle3.extract.vllm_plugin import FINAL_HIDDEN_ENV
from eagle3.targets.aux_layers import family_names, target_family, vllm_captures_final, vllm_extract_ids
from eagle3.vllm_env import apply_vllm_env

CONNECTOR = "ExampleHiddenStatesConnector"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def load_llm_class() -> tuple[Any, Any]:
    """(vllm.LLM, vllm.SamplingParams); one clear line where vLLM cannot run."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise StageError("extract.engine=vllm needs vLLM (run extract in the serve image); "
                         "use extract.engine=hf for a target that fits transformers") from None
    if not torch.cuda.is_available():
        raise StageError("extract.engine=vllm needs CUDA GPUs")
    return LLM, SamplingParams


def final_by_layer_id(config: Any, vllm_version: tuple[int, int, int]) -> bool:
    """True: this vLLM captures id L for the target (the id-L path); False: the plugin fills the final slot."""
    family = target_family(config)
    if family is None:
        raise StageError(f"extract.engine=vllm knows how vLLM captures the final hidden state for the families "
                         f"{family_names()} only, not model_type {getattr(config, 'model_type', None)!r}: "
                         "use extract.engine=hf")
    return vllm_captures_final(family, vllm_version)


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm, applied as transformers' LlamaRMSNorm / DeepseekV3RMSNorm do."""

    weight: torch.Tensor  # [H], as stored in the checkpoint
    eps: float

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] pre-norm -> post-norm, in ``hidden``'s dtype (the dtype the target ran in)."""
        dtype = hidden.dtype
        x = hidden.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x.to(dtype)


@dataclass(frozen=True)
class VllmExtractor:
    llm: Any  # vllm.LLM
    sampling_params: Any  # one token, greedy
    final_norm: FinalNorm | None  # the id-L path: the final state arrives before the norm


def llm_kwargs(model: str, layer_ids: list[int], storage_dir: Path, tensor_parallel_size: int,
               trust_remote_code: bool, max_model_len: int, gpu_memory_utilization: float,
               enforce_eager: bool, dtype: str) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` (0.22.1-0.34.x) for hidden-state extraction (pure: values in, dict out)."""
    return {
        "model": model,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enforce_eager": enforce_eager,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_model_len,  # a whole sample in one step
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
        },
    }


def read_connector_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states [T, n, H], token_ids [T]) of one request, once its writer released the lock."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    try:
        with open(lock) if lock.exists() else open(os.devnull) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # the connector holds LOCK_EX until the file is written
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                if not {"hidden_states", "token_ids"} <= keys:
                    raise StageError(f"vLLM hidden-states file {path} holds {sorted(keys)}, not hidden_states + token_ids")
                return f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    except (OSError, ValueError) as e:
        raise StageError(f"cannot read vLLM hidden-states file {path}: {e}") from None


def remove_connector_file(path: str | Path) -> None:
    path = Path(path)
    for p in (path, path.with_name(path.name + ".lock")):
        p.unlink(missing_ok=True)


def extract_shard_vllm(ex: VllmExtractor, data: TokenizedSamples, plan: ShardPlan, hidden_size: int,
                       storage_dtype: str, stats: ShardStats) -> HiddenShard:
    """One shard: its samples through vLLM in one ``generate``, the connector's files into our layout."""
    a, b = int(data.offsets[plan.first]), int(data.offsets[plan.end])
    offsets = data.offsets[plan.first : plan.end + 1] - a  # [n+1]
    t, h = b - a, hidden_size
    aux, final, aux_scale, final_scale = shard_buffers(t, h, storage_dtype)
    prompts = [{"prompt_token_ids": data.input_ids[a + int(offsets[j]) : a + int(offsets[j + 1])].tolist()}
               for j in range(plan.end - plan.first)]
    t0 = time.perf_counter()
    outputs = ex.llm.generate(prompts, ex.sampling_params, use_tqdm=False)
    if len(outputs) != len(prompts):
        raise StageError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} samples of shard {plan.index}")
    for j, (prompt, out) in enumerate(zip(prompts, outputs)):
        sample = int(data.sample_ids[plan.first + j])
        path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
        if not path:
            raise StageError(f"vLLM returned no hidden_states_path for sample {sample}: is {CONNECTOR} configured?")
        states, token_ids = read_connector_file(path)  # [n_j, 4, H], [n_j]
        ids = prompt["prompt_token_ids"]
        if token_ids.tolist() != ids or tuple(states.shape) != (len(ids), 4, h):
            raise StageError(f"vLLM hidden states of sample {sample} do not match it: "
                             f"{tuple(states.shape)} for {len(ids)} tokens (want ({len(ids)}, 4, {h})), token ids "
                             f"{'equal' if token_ids.tolist() == ids else 'differ'}")
        if ex.final_norm is not None:
            states = torch.cat([states[:, :3], ex.final_norm(states[:, 3])[:, None]], dim=1)
        dst = slice(int(offsets[j]), int(offsets[j + 1]))
        q, scale = to_storage(states.reshape(len(ids), 4 * h), storage_dtype, groups=4)  # [n_j, 4H], [n_j, 4]
        aux[dst], final[dst] = q[:, : 3 * h], q[:, 3 * h :]
        if aux_scale is not None and final_scale is not None and scale is not None:
            aux_scale[dst], final_scale[dst] = scale[:, :3], scale[:, 3:]
        remove_connector_file(path)
        stats.real_tokens += len(ids)
        stats.padded_tokens += len(ids)
    stats.batches_s += time.perf_counter() - t0
    return HiddenShard(
        input_ids=data.input_ids[a:b].clone(), loss_mask=data.loss_mask[a:b].clone(), offsets=offsets.clone(),
        sample_ids=data.sample_ids[plan.first : plan.end].clone(), aux_hidden=aux, final_hidden=final,
        aux_scale=aux_scale, final_scale=final_scale,
    )


def open_llm(cfg: Any, model: str, config: Any, aux_layer_ids: list[int], max_model_len: int,
             vllm_version: tuple[int, int, int]) -> VllmExtractor:
    """The vLLM engine for extraction on this vLLM, the sampling params of its one-token requests, and
    the final norm to apply where vLLM hands out the final state before it."""
    from eagle3.targets.checkpoint import checkpoint_dir, final_norm_weight
    from eagle3.targets.load import num_layers, rms_norm_eps, target_dtype

    by_id = final_by_layer_id(config, vllm_version)
    final_norm = None
    if by_id:
        root = checkpoint_dir(model, cfg.target.cache_dir)
        final_norm = FinalNorm(final_norm_weight(root), rms_norm_eps(config))
        os.environ.pop(FINAL_HIDDEN_ENV, None)  # vLLM's processes inherit it: the plugin stays inert
    else:
        os.environ[FINAL_HIDDEN_ENV] = "1"  # read by eagle3.extract.vllm_plugin in vLLM's processes
        os.environ[V2_RUNNER_ENV] = "0"  # the plugin hooks Model Runner V1, which these releases run it on
    apply_vllm_env()
    llm_cls, params_cls = load_llm_class()
    v = cfg.extract.vllm
    storage = Path(v.hidden_states_dir)
    storage.mkdir(parents=True, exist_ok=True)
    tp = v.tensor_parallel_size or max(torch.cuda.device_count(), 1)
    ids = vllm_extract_ids(aux_layer_ids, num_layers(config), by_id)
    kwargs = llm_kwargs(model, ids, storage, tp, cfg.target.trust_remote_code, max_model_len,
                        v.gpu_memory_utilization, v.enforce_eager, target_dtype(cfg.target, "cuda", config))
    return VllmExtractor(llm_cls(**kwargs), params_cls(max_tokens=1, temperature=0.0), final_norm)
