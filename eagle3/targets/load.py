"""Find and load the target: its config, tokenizer and model, from one ``TargetSettings``.

``builtin:tiny-llama`` / ``builtin:tiny-deepseek`` are built (once, deterministically)
into ``settings.cache_dir``; anything else is an HF directory or hub id. Every stage and
the local server launcher resolve the target through :func:`resolve_target`, so they
agree on the path, and through :func:`served_model_name` on the name the endpoint serves.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.errors import StageError
from eagle3.settings.target import TargetSettings

if TYPE_CHECKING:
    import torch

BUILTIN_PREFIX = "builtin:"
BUILTIN_TARGETS = {"tiny-llama": "llama", "tiny-deepseek": "deepseek", "tiny-kimi": "kimi"}


def builtin_arch(model: str) -> str | None:
    """The tiny-target architecture of a ``builtin:`` model name, else None."""
    if not model.startswith(BUILTIN_PREFIX):
        return None
    name = model[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_TARGETS:
        raise StageError(f"unknown builtin target {model!r}; choose one of "
                         + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_TARGETS))
    return BUILTIN_TARGETS[name]


def resolve_target(settings: TargetSettings) -> str:
    """A local directory (absolute) or an HF hub id; builtin targets are built on first use."""
    arch = builtin_arch(settings.model)
    if arch is not None:
        from eagle3.targets.tiny import builtin_target_dir

        return str(builtin_target_dir(arch, Path(settings.cache_dir)))
    local = Path(settings.model).expanduser()
    if local.is_dir():
        return str(local.resolve())
    return settings.model


def served_model_name(settings: TargetSettings) -> str:
    """The ``model`` field requests carry: what the server was started with, unless renamed."""
    return settings.served_name or resolve_target(settings)


def _tokenizer_source(settings: TargetSettings) -> str:
    if settings.tokenizer is None:
        return resolve_target(settings)
    local = Path(settings.tokenizer).expanduser()
    return str(local.resolve()) if local.is_dir() else settings.tokenizer


def _text_config(config: Any) -> Any:
    """Multimodal wrappers (Kimi-K2.5's) keep the language model's fields in ``text_config``."""
    text = getattr(config, "text_config", None)
    return text if text is not None and hasattr(text, "num_hidden_layers") else config


def load_target_config(settings: TargetSettings) -> Any:
    from transformers import AutoConfig

    source = resolve_target(settings)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError) as e:
        raise StageError(f"cannot load target config from {source}: {_first_line(e)}") from None


# The fields every check before a stage reads (vocab, layers, the fit estimate's shapes); a config.json
# without one of them is read by AutoConfig, whose model class supplies its default.
_CHECKED_FIELDS = ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")


class JsonConfig(dict):
    """A target's ``config.json`` as loaded JSON, its fields also readable as attributes
    (``config.text_config.vocab_size``), as the checks read a transformers config."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return JsonConfig(value) if isinstance(value, dict) and not isinstance(value, JsonConfig) else value


def target_config_for_checks(settings: TargetSettings) -> Any:
    """The target's config for the checks made before a stage runs (draft vocab, aux layers, does
    it fit the engine).

    A local target's ``config.json`` is read as JSON when it names every field those checks read:
    importing torch and transformers for ``AutoConfig`` is most of the CLI's start-up (3.7 s on
    a 2-core CPU box, 12-18 s on a GPU machine) and the stages load the real config anyway.
    Anything else (a hub id, a config without those fields, one transformers must interpret or
    reject) goes through :func:`load_target_config`, so its errors are the stages' errors.
    """
    path = Path(resolve_target(settings)) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict):
        config = JsonConfig(data)
        text = _text_config(config)
        if all(isinstance(text.get(k), int) and not isinstance(text.get(k), bool) for k in _CHECKED_FIELDS):
            return config
    return load_target_config(settings)


def tokenizer_size_for_checks(settings: TargetSettings) -> int:
    """``len(tokenizer)`` for the checks made before a stage runs.

    A local ``tokenizer.json`` that is the whole tokenizer (no remote-code class in
    ``tokenizer_config.json``) is counted with the tokenizers library, which is what
    transformers' fast tokenizer wraps; anything else is loaded as the stages load it."""
    source = Path(_tokenizer_source(settings))
    tokenizer_json, tokenizer_config = source / "tokenizer.json", source / "tokenizer_config.json"
    with contextlib.suppress(Exception):  # unreadable here: AutoTokenizer says why, as in the stage
        remote = tokenizer_config.is_file() and "auto_map" in json.loads(tokenizer_config.read_text())
        if tokenizer_json.is_file() and not remote:
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    return len(load_tokenizer(settings))


def load_tokenizer(settings: TargetSettings) -> Any:
    from transformers import AutoTokenizer

    source = _tokenizer_source(settings)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError) as e:
        raise StageError(f"cannot load target tokenizer from {source}: {_first_line(e)}") from None


DTYPES = ("bfloat16", "float16", "float32")


def config_dtype(config: Any) -> str | None:
    """The dtype a target's config names (``dtype`` or ``torch_dtype``, else its text config's), or None."""
    for c in (config, getattr(config, "text_config", None)):
        for key in ("dtype", "torch_dtype"):
            value = getattr(c, key, None) if c is not None else None
            if value is not None:
                return str(value).removeprefix("torch.")
    return None


def target_dtype(settings: TargetSettings, device_type: str, config: Any | None = None) -> str:
    """The dtype the target runs in, in every engine: ``target.dtype`` unless it is ``auto``.

    ``auto`` is vLLM's own rule where a GPU runs the target (``_resolve_auto_dtype`` on an
    Ampere or newer GPU): the config's dtype, float32 (or none given) downcast to bfloat16. On
    CPU, where only transformers runs (``transformers serve --dtype auto`` does the same), it is
    the config's dtype, float32 when none is given. Hidden states are extracted in this dtype,
    so the drafter learns what it will see: stages that run on different kinds of device agree
    only when ``target.dtype`` is set.
    """
    if settings.dtype != "auto":
        return settings.dtype
    own = config_dtype(config if config is not None else target_config_for_checks(settings))
    if device_type == "cuda":
        return own if own in ("bfloat16", "float16") else "bfloat16"
    return own if own in DTYPES else "float32"


def resolve_dtype(settings: TargetSettings, device: str | torch.device) -> torch.dtype:
    """:func:`target_dtype` on ``device`` as a torch dtype."""
    import torch

    return getattr(torch, target_dtype(settings, torch.device(device).type))


def auto_model_class(settings: TargetSettings) -> Any:
    """The transformers auto class that loads the target with its lm_head.

    Multimodal wrappers (Kimi-K2.5: ``kimi_k25``, a vision tower around a DeepseekV3 text
    model) are image-text-to-text models in transformers, not causal LMs; remote-code
    targets name their class in ``auto_map`` and load as causal LMs.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    config = load_target_config(settings)
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    mtype = getattr(config, "model_type", "")
    if not remote and mtype not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mtype in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_target_model(settings: TargetSettings, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None) -> Any:
    """The target in eval mode on ``device``; ``dtype`` defaults to :func:`target_dtype`'s."""
    source = resolve_target(settings)
    if dtype is None or isinstance(dtype, str):
        dtype = resolve_dtype(settings.model_copy(update={"dtype": dtype}) if dtype else settings, device)
    try:
        model = auto_model_class(settings).from_pretrained(source, dtype=dtype, trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError) as e:
        raise StageError(f"cannot load target model from {source}: {_first_line(e)}") from None
    return model.to(device).eval()


def num_layers(config: Any) -> int:
    """Decoder layers of the target (MTP layers of DeepseekV3 are not counted)."""
    return int(_text_config(config).num_hidden_layers)


def hidden_size(config: Any) -> int:
    return int(_text_config(config).hidden_size)


def rms_norm_eps(config: Any) -> float:
    """The epsilon of the target's RMSNorms (its final norm's among them)."""
    eps = getattr(_text_config(config), "rms_norm_eps", None)
    if eps is None:
        raise StageError("the target config has no rms_norm_eps")
    return float(eps)


def target_vocab_size(config: Any) -> int:
    """Rows of the lm_head: may exceed ``len(tokenizer)`` (padded vocab)."""
    return int(_text_config(config).vocab_size)


def check_vocab(settings: TargetSettings, tokenizer: Any, config: Any) -> int:
    """The target vocab size, after checking tokenizer and configured size agree with it."""
    return check_vocab_size(settings, len(tokenizer), config)


def check_vocab_size(settings: TargetSettings, n_tokens: int, config: Any) -> int:
    """:func:`check_vocab` for a tokenizer of ``n_tokens`` tokens (added tokens included)."""
    vocab = target_vocab_size(config)
    if settings.vocab_size is not None and settings.vocab_size != vocab:
        raise StageError(f"target.vocab_size is {settings.vocab_size} but the target config {resolve_target(settings)} "
                         f"has vocab_size {vocab}")
    if n_tokens > vocab:
        raise StageError(f"tokenizer {_tokenizer_source(settings)} has {n_tokens} tokens but target vocab_size is {vocab}")
    return vocab


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
