"""Load the target for a GPU stage: one device when it fits, spread over all GPUs when not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3.errors import StageError
from eagle3.settings.target import TargetSettings

# Share of one GPU's memory the weights may take before we spread over all visible GPUs
# (the rest holds activations of a batch).
FIT_FRACTION = 0.8


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise StageError(f"device {name!r} requested but CUDA is not available on this machine")
    return torch.device(name)


def weight_bytes(source: str) -> int | None:
    """Bytes of the checkpoint's weight files, when it is a local directory."""
    p = Path(source)
    if not p.is_dir():
        return None
    return sum(f.stat().st_size for f in p.glob("*.safetensors")) or sum(f.stat().st_size for f in p.glob("*.bin")) or None


def needs_device_map(source: str, device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return False
    size = weight_bytes(source)
    total = torch.cuda.get_device_properties(device.index or 0).total_memory
    return size is None or size > FIT_FRACTION * total


def load_target(settings: TargetSettings, device: torch.device) -> Any:
    """The target in eval mode: on ``device``, or ``device_map="auto"`` over every visible GPU."""
    from eagle3.targets.load import load_target_model, resolve_dtype, resolve_target

    source = resolve_target(settings)
    dtype = resolve_dtype(settings, device)
    if not needs_device_map(source, device):
        return load_target_model(settings, device, dtype)
    from eagle3.targets.load import auto_model_class

    try:
        model = auto_model_class(settings).from_pretrained(
            source, dtype=dtype, device_map="auto", trust_remote_code=settings.trust_remote_code
        )
    except (OSError, ValueError, ImportError) as e:
        raise StageError(f"cannot load target model from {source} over {torch.cuda.device_count()} GPUs: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    return model.eval()
