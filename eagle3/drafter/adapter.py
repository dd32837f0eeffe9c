"""Drafter weights in and out, against an explicit key list (the names vLLM's loader reads)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.errors import StageError

EXPORT_KEYS: tuple[str, ...] = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
)
WEIGHTS = "drafter.safetensors"
CONFIG = "drafter_config.json"


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "fc.weight": (h, 3 * cfg.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }


def check_weights(cfg: DrafterConfig, shapes: dict[str, tuple[int, ...]], where: str) -> list[str]:
    """Problems with a set of tensor shapes against the config (empty when they agree)."""
    problems = []
    for key, shape in expected_shapes(cfg).items():
        if key not in shapes:
            problems.append(f"{where} lacks tensor {key}")
        elif tuple(shapes[key]) != shape:
            problems.append(f"{where}: {key} has shape {tuple(shapes[key])}, config says {shape}")
    return problems


def exportable_state_dict(model: Eagle3Drafter) -> dict[str, Tensor]:
    """The drafter's tensors under :data:`EXPORT_KEYS`, in that order (the frozen embedding is the target's)."""
    sd = model.state_dict()
    return {k: sd[k] for k in EXPORT_KEYS}


def save_drafter(model: Eagle3Drafter, out_dir: Path) -> tuple[Path, Path]:
    """Write drafter.safetensors (exportable names, float32) + drafter_config.json into out_dir."""
    return save_drafter_state(exportable_state_dict(model), model.config, out_dir)


def save_drafter_state(state: dict[str, Tensor], cfg: DrafterConfig, out_dir: Path) -> tuple[Path, Path]:
    """Same, from a state dict holding (at least) the exportable keys."""
    problems = check_weights(cfg, {k: tuple(v.shape) for k, v in state.items()}, "drafter state")
    if problems:
        raise StageError(problems[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: state[k].detach().float().cpu().contiguous() for k in EXPORT_KEYS}
    save_file(weights, str(out_dir / WEIGHTS), metadata={"format": "eagle3.drafter.v1"})
    (out_dir / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    return out_dir / WEIGHTS, out_dir / CONFIG


def midlayer_key(key: str) -> str:
    """Our name of a drafter tensor named ``layers.0.*`` (vLLM accepts both; speculators writes it)."""
    return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key


def load_drafter(path: Path | str, embed_weight: Tensor, cfg: DrafterConfig | None = None) -> Eagle3Drafter:
    """A drafter from drafter.safetensors (+ drafter_config.json beside it) or an export dir.

    ``embed_weight`` [V, H] is the target's embedding (never part of the drafter's files).
    """
    path = Path(path)
    if path.is_dir():
        weights = path / WEIGHTS if (path / WEIGHTS).exists() else path / "model.safetensors"
        config_path = path / CONFIG
    else:
        weights, config_path = path, path.parent / CONFIG
    if cfg is None:
        if not config_path.exists():
            raise StageError(f"no {CONFIG} beside {weights}")
        cfg = DrafterConfig.from_dict(json.loads(config_path.read_text()))
    if not weights.exists():
        raise StageError(f"drafter weights not found: {weights}")
    with safe_open(str(weights), framework="pt") as f:
        tensors = {midlayer_key(k): f.get_tensor(k) for k in f.keys()}
    problems = check_weights(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, str(weights))
    if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        problems.append(f"target embedding has shape {tuple(embed_weight.shape)}, drafter expects {(cfg.vocab_size, cfg.hidden_size)}")
    if problems:
        raise StageError(problems[0])
    model = Eagle3Drafter(cfg)
    state = {k: tensors[k].float() for k in EXPORT_KEYS}
    state["embed_tokens.weight"] = embed_weight.detach().float()
    model.load_state_dict(state, strict=True)
    return model
