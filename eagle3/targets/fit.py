"""Does the target fit the engine a GPU stage would load it with? Decided from its config alone.

Weight bytes after loading = parameters (counted from the text config: embeddings, MLA or
GQA attention, dense and MoE MLPs, norms, lm_head) x the bytes each takes in that engine:

- ``hf`` (transformers, ``device_map`` over the node's GPUs): the load dtype (``target_dtype``),
  quantized checkpoints dequantized on load (compressed-tensors INT4 becomes bf16), except
  fp8 checkpoints, which transformers keeps in fp8;
- ``vllm``: quantized weights stay quantized (bits + group scales), the rest in bf16.

Kimi-K2.5 (~1.03T parameters, routed experts INT4 in groups of 32): ~0.6 TB in vLLM, ~2 TB
under transformers, more than an 8 x H200 node holds (1.13 TB). :func:`check_fit` refuses
the wrong engine before anything loads, in one line naming the engine to use. The vision
tower of a multimodal wrapper is not counted (Kimi-K2.5's: ~0.4B parameters, 0.04 %).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from eagle3.errors import ConfigError

HF_FIT_FRACTION = 0.8  # share of the GPUs' memory transformers' weights may take (activations need the rest)
VLLM_FIT_FRACTION = 0.85  # vLLM also needs room for the KV cache and its CUDA graphs
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CATEGORIES = ("embed", "lm_head", "attention", "dense_mlp", "routed_experts", "shared_experts", "router", "norms")
LINEAR = ("attention", "dense_mlp", "routed_experts", "shared_experts", "lm_head")  # quantizable Linear weights


# Device nodes of the NVIDIA driver (also inside containers given GPUs) and of ROCm's, which torch.cuda drives too.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


@dataclass(frozen=True)
class Gpus:
    count: int
    bytes_each: int

    @classmethod
    def detect(cls) -> Gpus | None:
        """This machine's GPUs as torch sees them; None without a GPU driver, before importing torch
        (seconds of a CLI's start-up, for an answer the device nodes already give)."""
        if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
            return None
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return None
        n = torch.cuda.device_count()
        return cls(n, min(torch.cuda.get_device_properties(i).total_memory for i in range(n)))

    @property
    def total(self) -> int:
        return self.count * self.bytes_each


@dataclass(frozen=True)
class WeightBytes:
    params: int
    quantized_params: int
    method: str | None  # quantization method of the checkpoint, None when it has none
    hf: int  # bytes once transformers has loaded it
    vllm: int  # bytes as vLLM holds it


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    return default if value is None else value


def text_config(config: Any) -> Any:
    text = _get(config, "text_config")
    return text if text is not None and _get(text, "num_hidden_layers") else config


def moe_layers(text: Any) -> list[bool]:
    """Which decoder layers are MoE (DeepseekV3: from ``first_k_dense_replace``, every ``moe_layer_freq``)."""
    n_layers = int(_get(text, "num_hidden_layers"))
    experts = _get(text, "n_routed_experts") or _get(text, "num_experts") or _get(text, "num_local_experts") or 0
    first, freq = int(_get(text, "first_k_dense_replace", 0)), int(_get(text, "moe_layer_freq", 1))
    return [bool(experts) and i >= first and (i - first) % freq == 0 for i in range(n_layers)]


def parameter_counts(config: Any) -> dict[str, int]:
    """Parameters per category of the language model (vision tower not counted)."""
    t = text_config(config)
    h, v, n_layers = int(_get(t, "hidden_size")), int(_get(t, "vocab_size")), int(_get(t, "num_hidden_layers"))
    heads = int(_get(t, "num_attention_heads"))
    if _get(t, "kv_lora_rank"):  # MLA (DeepseekV3 / Kimi)
        qk = int(_get(t, "qk_nope_head_dim")) + int(_get(t, "qk_rope_head_dim"))
        q_rank, kv_rank = int(_get(t, "q_lora_rank", 0)), int(_get(t, "kv_lora_rank"))
        q = h * q_rank + q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        kv = h * (kv_rank + int(_get(t, "qk_rope_head_dim"))) + kv_rank
        kv += kv_rank * heads * (int(_get(t, "qk_nope_head_dim")) + int(_get(t, "v_head_dim")))
        attn = q + kv + heads * int(_get(t, "v_head_dim")) * h
    else:  # multi-head / grouped-query attention
        hd = int(_get(t, "head_dim") or h // heads)
        kv_heads = int(_get(t, "num_key_value_heads") or heads)
        attn = 2 * h * heads * hd + 2 * h * kv_heads * hd
        if _get(t, "attention_bias", False):
            attn += heads * hd + 2 * kv_heads * hd + h
    moe = moe_layers(t)
    experts = int(_get(t, "n_routed_experts") or _get(t, "num_experts") or _get(t, "num_local_experts") or 0)
    moe_i = int(_get(t, "moe_intermediate_size") or _get(t, "intermediate_size"))
    n_moe = sum(moe)
    tied = bool(_get(config, "tie_word_embeddings", _get(t, "tie_word_embeddings", False)))
    return {
        "embed": v * h,
        "lm_head": 0 if tied else v * h,
        "attention": n_layers * attn,
        "dense_mlp": (n_layers - n_moe) * 3 * h * int(_get(t, "intermediate_size")),
        "routed_experts": n_moe * experts * 3 * h * moe_i,
        "shared_experts": n_moe * int(_get(t, "n_shared_experts", 0)) * 3 * h * moe_i,
        "router": n_moe * experts * h,  # (+ a bias per expert under noaux_tc: a buffer in transformers, negligible)
        "norms": n_layers * 2 * h + h,
    }


def quantization_config(config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization_config (Kimi-K2.5 keeps it in ``text_config``)."""
    for source in (config, text_config(config)):
        q = _get(source, "quantization_config")
        if q is not None:
            return q if isinstance(q, dict) else q.to_dict()
    return None


# A representative module name per quantizable category (HF naming), matched against ignore lists.
_NAMES = {"attention": ("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"),
          "dense_mlp": ("mlp.gate_proj",), "routed_experts": ("mlp.experts.0.gate_proj",),
          "shared_experts": ("mlp.shared_experts.gate_proj",)}


def _ignored(name: str, ignore: list[str]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.search(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern) or pattern.endswith("." + name) or pattern.endswith(name):
            return True
    return False


def quantized_share(category: str, n_layers: int, ignore: list[str]) -> float:
    """Share of a category's layers whose weights are quantized (the rest are in the ignore list)."""
    if category == "lm_head":
        return 0.0 if _ignored("lm_head", ignore) else 1.0
    quantized = sum(not all(_ignored(f"model.layers.{i}.{n}", ignore) for n in _NAMES[category]) for i in range(n_layers))
    return quantized / n_layers


def quantized_bits(q: dict[str, Any]) -> tuple[float, list[str], str]:
    """(bits per quantized weight incl. scales, ignore list, method) of a quantization_config."""
    method = str(q.get("quant_method", "unknown"))
    if method == "compressed-tensors":
        group = next(iter((q.get("config_groups") or {}).values()), {})
        w = group.get("weights") or {}
        bits, size = float(w.get("num_bits", 16)), w.get("group_size")
        scale_bits = 16.0 / size if size else 0.0  # one bf16 scale per group
        if not w.get("symmetric", True) and size:
            scale_bits *= 2  # and a zero point
        return bits + scale_bits, list(q.get("ignore") or []), method
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        return 8.0 + 32.0 / (block[0] * block[1]), list(q.get("modules_to_not_convert") or []), method
    bits, size = float(q.get("bits", q.get("w_bit", 16))), q.get("group_size", q.get("q_group_size"))
    return bits + (16.0 / size if size and size > 0 else 0.0), list(q.get("modules_to_not_convert") or []), method


def weight_bytes(config: Any, hf_dtype_bytes: int = 2, vllm_dtype_bytes: int = 2) -> WeightBytes:
    counts = parameter_counts(config)
    total = sum(counts.values())
    q = quantization_config(config)
    if q is None:
        return WeightBytes(total, 0, None, total * hf_dtype_bytes, total * vllm_dtype_bytes)
    bits, ignore, method = quantized_bits(q)
    n_layers = int(_get(text_config(config), "num_hidden_layers"))
    quantized = sum(int(counts[c] * quantized_share(c, n_layers, ignore)) for c in LINEAR if counts[c])
    plain = total - quantized
    vllm = int(plain * vllm_dtype_bytes + quantized * bits / 8)
    hf = int(plain * hf_dtype_bytes + quantized * (bits / 8 if method == "fp8" else hf_dtype_bytes))
    return WeightBytes(total, quantized, method, hf, vllm)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _tb(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.0f} GB"


def fit_problem(weights: WeightBytes, engine: str, gpus: Gpus | None, setting: str, host_bytes: int | None = None) -> str | None:
    """One line saying why ``engine`` cannot hold the target's weights on ``gpus``, or None."""
    quant = f"its {weights.method} weights dequantized on load" if weights.method and weights.method != "fp8" else ""
    if engine == "hf":
        where = (f"{gpus.count} GPU{'s' * (gpus.count > 1)} x {_tb(gpus.bytes_each)}" if gpus
                 else f"{_tb(host_bytes or host_memory_bytes())} of host memory")
        capacity = (gpus.total if gpus else (host_bytes or host_memory_bytes())) * HF_FIT_FRACTION
        if weights.hf > capacity:
            vllm_fits = gpus is not None and weights.vllm <= gpus.total * VLLM_FIT_FRACTION
            advice = (f"set {setting}: vllm (vLLM holds it in {_tb(weights.vllm)})" if vllm_fits or gpus is None
                      else f"it does not fit vLLM either ({_tb(weights.vllm)}): use a node with more GPU memory")
            return (f"target needs {_tb(weights.hf)} of weights under transformers{' (' + quant + ')' if quant else ''}, "
                    f"more than {int(HF_FIT_FRACTION * 100)}% of {where}; {advice}")
        return None
    if gpus is not None and weights.vllm > gpus.total * VLLM_FIT_FRACTION:
        return (f"target needs {_tb(weights.vllm)} of weights in vLLM, more than {int(VLLM_FIT_FRACTION * 100)}% of "
                f"{gpus.count} GPUs x {_tb(gpus.bytes_each)}; use a node with more GPU memory")
    return None


def check_fit(cfg: Any, stage: str, gpus: Gpus | None = None) -> None:
    """Raise :class:`ConfigError` (one line naming the engine to use) if ``stage``'s engine cannot hold the target.

    ``stage`` is ``extract`` or ``evaluate``; ``gpus`` defaults to this machine's (CPU: host
    memory for ``hf``; ``vllm`` is not checked without GPUs). For a DAG preflight, pass the
    node's GPUs.
    """
    from eagle3.errors import StageError
    from eagle3.targets.load import target_config_for_checks, target_dtype

    setting = f"{stage}.engine"
    engine = getattr(cfg, stage).engine
    try:
        config = target_config_for_checks(cfg.target)
    except StageError as e:
        raise ConfigError(f"{setting}: cannot check that the target fits: {e}") from None
    gpus = gpus if gpus is not None else Gpus.detect()
    dtype = target_dtype(cfg.target, "cuda" if gpus else "cpu", config)
    problem = fit_problem(weight_bytes(config, DTYPE_BYTES[dtype]), engine, gpus, setting)
    if problem:
        raise ConfigError(f"{setting}={engine}: {cfg.target.model}: {problem}")


def preflight(cfg: Any, stage: str) -> None:
    """The DAG preflight's fit check (``StageSpec.preflight``): on the local backend, against this
    machine's GPUs; on Kubernetes the node's GPUs are not here, and the stage checks in its pod."""
    if cfg.backend == "local":
        check_fit(cfg, stage)


def preflight_extract(cfg: Any) -> None:
    preflight(cfg, "extract")


def preflight_evaluate(cfg: Any) -> None:
    preflight(cfg, "evaluate")
