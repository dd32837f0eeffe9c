"""extract.engine = vllm: hidden states from the target running in vLLM, converted into our shards.

For targets too big for transformers on the node (Kimi-K2.5: INT4 as shipped), the target
runs in vLLM (the serve image's, pinned in images/serve.Dockerfile: vLLM 0.22.1) with the
``extract_hidden_states`` speculative method and ``ExampleHiddenStatesConnector``. What
vLLM 0.22.1 does, read from its source:

- ``speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}``
  (``config/speculative.py``); the ids go to the target's ``set_aux_hidden_state_layers``
  (``v1/worker/gpu_model_runner.py``), in vLLM's convention: id k = the input of decoder
  layer k, our convention too, so ids pass through unchanged.
- The connector writes one file per request, ``{shared_storage_path}/{req_id}.safetensors``
  with ``hidden_states`` [prompt_len, num_ids, hidden] and ``token_ids`` [prompt_len] (the
  prompt's), and a ``.lock`` beside it held exclusively until the write ends
  (``distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``). The
  path comes back in ``RequestOutput.kv_transfer_params["hidden_states_path"]``.
- It saves a whole prompt from one forward step: chunked prefill must be off (the docs say
  so) and prefix caching too (a cached prefix is not recomputed, so its states would be
  missing from the step), and a batch must hold the longest sample.
- The final hidden state is not among the ids: DeepseekV2/V3 models (Kimi's text model)
  collect ids only as inputs of layers 0..L-1, and Llama-style ones give id L *before* the
  final norm. So the id list ends with :data:`FINAL_SLOT`, which no layer captures, and
  :mod:`eagle3.extract.vllm_plugin` (a ``vllm.general_plugins`` entry point, active when
  :data:`FINAL_HIDDEN_ENV` is set) fills it with the model's output: the final hidden state
  after the final norm, as the ``hf`` engine stores it.

Each shard's samples are one ``generate`` call of ``max_tokens=1``; their files are read (under
the lock), checked against the samples' tokens, placed into the shard, and deleted, and the
shard streams to the store as the ``hf`` engine's do. Shards are planned identically, so a
rerun adopts finished shards and extracts only the rest.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.data.tokenized import TokenizedSamples
from eagle3.errors import StageError
from eagle3.extract.batching import ShardPlan
from eagle3.extract.run import ShardStats, shard_buffers, to_storage
from eagle3.extract.shards import HiddenShard

CONNECTOR = "ExampleHiddenStatesConnector"
FINAL_SLOT = -1  # an aux id no layer matches: the plugin puts the final hidden state there
FINAL_HIDDEN_ENV = "EAGLE3_VLLM_FINAL_HIDDEN"


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


def llm_kwargs(model: str, aux_layer_ids: list[int], storage_dir: Path, tensor_parallel_size: int,
               trust_remote_code: bool, max_model_len: int, gpu_memory_utilization: float,
               enforce_eager: bool) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` (0.22.1) for hidden-state extraction (pure: values in, dict out)."""
    return {
        "model": model,
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
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*aux_layer_ids, FINAL_SLOT]}},
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


def extract_shard_vllm(llm: Any, sampling_params: Any, data: TokenizedSamples, plan: ShardPlan, hidden_size: int,
                       storage_dtype: str, stats: ShardStats) -> HiddenShard:
    """One shard: its samples through vLLM in one ``generate``, the connector's files into our layout."""
    a, b = int(data.offsets[plan.first]), int(data.offsets[plan.end])
    offsets = data.offsets[plan.first : plan.end + 1] - a  # [n+1]
    t, h = b - a, hidden_size
    aux, final, aux_scale, final_scale = shard_buffers(t, h, storage_dtype)
    prompts = [{"prompt_token_ids": data.input_ids[a + int(offsets[j]) : a + int(offsets[j + 1])].tolist()}
               for j in range(plan.end - plan.first)]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    if len(outputs) != len(prompts):
        raise StageError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} samples of shard {plan.index}")
    for j, (prompt, out) in enumerate(zip(prompts, outputs)):
        path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
        if not path:
            raise StageError(f"vLLM returned no hidden_states_path for sample {int(data.sample_ids[plan.first + j])}: "
                             f"is {CONNECTOR} configured?")
        states, token_ids = read_connector_file(path)  # [n_j, 4, H], [n_j]
        ids = prompt["prompt_token_ids"]
        if token_ids.tolist() != ids or tuple(states.shape) != (len(ids), 4, h):
            raise StageError(f"vLLM hidden states of sample {int(data.sample_ids[plan.first + j])} do not match it: "
                             f"{tuple(states.shape)} for {len(ids)} tokens (want ({len(ids)}, 4, {h})), token ids "
                             f"{'equal' if token_ids.tolist() == ids else 'differ'}")
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


def open_llm(cfg: Any, model: str, aux_layer_ids: list[int], max_model_len: int) -> tuple[Any, Any]:
    """The vLLM engine for extraction and the sampling params of its one-token requests."""
    llm_cls, params_cls = load_llm_class()
    v = cfg.extract.vllm
    storage = Path(v.hidden_states_dir)
    storage.mkdir(parents=True, exist_ok=True)
    os.environ[FINAL_HIDDEN_ENV] = "1"  # read by eagle3.extract.vllm_plugin in vLLM's processes
    tp = v.tensor_parallel_size or max(torch.cuda.device_count(), 1)
    kwargs = llm_kwargs(model, aux_layer_ids, storage, tp, cfg.target.trust_remote_code, max_model_len,
                        v.gpu_memory_utilization, v.enforce_eager)
    return llm_cls(**kwargs), params_cls(max_tokens=1, temperature=0.0)
