"""The EAGLE-3 drafter: one Llama decoder layer fed the target's aux hidden states.

Math (as vLLM's ``llama_eagle3.py`` runs it at inference, default
``norm_before_residual=False``):

    h0   = fc(concat(aux_low, aux_mid, aux_high))            # step 0 only; later steps feed back `out`
    x    = concat(input_layernorm(embed(token)), hidden_norm(h))       # [.., 2H]
    r    = h + o_proj(attn(q/k/v_proj(x)))                             # residual from h, not the embed
    out  = r + mlp(post_attention_layernorm(r))                        # pre-norm output, fed back
    logits = lm_head(norm(out))                                        # [.., draft_vocab]

Attention goes through a cache object (:mod:`eagle3.drafter.caches`): ``KVCache`` for
token-by-token decoding, ``TTTCache`` for training-time test. Weight names in and out of
files are :mod:`eagle3.drafter.adapter`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.drafter.caches import KVCache, TTTCache
from eagle3.errors import ConfigError
from eagle3.settings.drafter import DrafterSettings


@dataclass
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab (embedding rows)
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    aux_layer_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        fields = cls.__dataclass_fields__
        known = set(fields)
        missing = [k for k, f in fields.items() if k not in d and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ConfigError(f"drafter config lacks {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_target(cls, target: Any, settings: DrafterSettings, draft_vocab_size: int, aux_layer_ids: list[int]) -> DrafterConfig:
        """Shape the drafter after a target HF config (object or dict); settings override.

        A multimodal wrapper's (Kimi-K2.5's) fields are read from its ``text_config``.
        """
        text = target.get("text_config") if isinstance(target, dict) else getattr(target, "text_config", None)
        if text is not None:
            target = text
        get = (lambda k, d=None: target.get(k, d)) if isinstance(target, dict) else (lambda k, d=None: getattr(target, k, d))
        target_hidden = int(get("hidden_size"))
        hidden = settings.hidden_size or target_hidden
        if hidden != target_hidden:
            raise ConfigError(
                f"drafter.hidden_size={hidden} differs from the target's hidden size {target_hidden}; the drafter "
                "reuses the target's embedding, so leave drafter.hidden_size unset"
            )
        heads = settings.num_attention_heads or int(get("num_attention_heads"))
        kv_heads = settings.num_key_value_heads or int(get("num_key_value_heads") or heads)
        head_dim = settings.head_dim or hidden // heads
        if heads % kv_heads:
            raise ConfigError(f"drafter.num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise ConfigError(f"drafter head_dim={head_dim} must be even for rotary embeddings; set drafter.head_dim")
        return cls(
            hidden_size=hidden,
            target_hidden_size=target_hidden,
            intermediate_size=settings.intermediate_size or int(get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(get("vocab_size")),
            draft_vocab_size=int(draft_vocab_size),
            rms_norm_eps=settings.rms_norm_eps,
            rope_theta=settings.rope_theta or target_rope_theta(get),
            max_position_embeddings=settings.max_position_embeddings or int(get("max_position_embeddings") or 8192),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
        )


def target_rope_theta(get: Any) -> float:
    """The target's RoPE base: ``rope_parameters`` (transformers >= 5), else ``rope_theta``, else 10000."""
    params = get("rope_parameters") or get("rope_scaling") or {}
    return float(params.get("rope_theta") or get("rope_theta") or 10000.0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """position_ids [B, T] → cos, sin [B, 1, T, head_dim] (float32, neox-style halves)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, h, T, D] rotated by position (rotate-half, as Llama and vLLM's neox style)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] → q [B, h, T, D], k/v [B, kv, T, D] (q and k rotated)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn: Tensor) -> Tensor:
        """[B, h, T, D] → [B, T, H]."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | TTTCache) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.out(cache.attend(q, k, v))


class Eagle3MLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """Split around attention into two pure halves (:meth:`before_attention`,
    :meth:`after_attention`), so training can compile them while the cache stays eager."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg.hidden_size, cfg.intermediate_size)
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self._before, self._after = self.before_attention, self.after_attention

    def before_attention(self, embeds: Tensor, hidden: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """embeds, hidden [B, T, H], position_ids [B, T] → q, k, v."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
        return self.self_attn.qkv(x, cos, sin)

    def after_attention(self, hidden: Tensor, attn: Tensor, out_norm: RMSNorm | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """hidden [B, T, H], attn [B, h, T, D] → pre-norm output [B, T, H]; with ``out_norm`` (the
        drafter's final norm) also out_norm(output), the draft head's input, in the same kernels."""
        residual = hidden + self.self_attn.out(attn)
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return out if out_norm is None else (out, out_norm(out))

    def forward(self, embeds: Tensor, hidden: Tensor, position_ids: Tensor, cache: KVCache | TTTCache,
                out_norm: RMSNorm | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """embeds, hidden [B, T, H] → pre-norm output [B, T, H] (and its ``out_norm``, when given)."""
        q, k, v = self._before(embeds, hidden, position_ids)
        return self._after(hidden, cache.attend(q, k, v), out_norm)

    def compile(self, **kwargs: Any) -> None:  # type: ignore[override]
        """Compile both halves; attention and its cache stay as they are. Shapes are static until a
        second one is seen (packed rows: one shape, the leanest code), dynamic after."""
        from eagle3.drafter.compiled import Compiled

        self._before = Compiled(self.before_attention, "drafter layer (before attention)", **kwargs)
        self._after = Compiled(self.after_attention, "drafter layer (after attention)", **kwargs)

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Both halves uncompiled inside (compiled ones come back after)."""
        saved = self._before, self._after
        self._before, self._after = self.before_attention, self.after_attention
        try:
            yield
        finally:
            self._before, self._after = saved


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def project_aux(self, aux_hidden: Tensor) -> Tensor:
        """[B, T, 3·Ht] → [B, T, H]."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def step_hidden(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor, cache: KVCache | TTTCache) -> Tensor:
        """One drafter step without the head: → pre-norm hidden [B, T, H] (fed back next step)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        return self.midlayer(embeds, hidden, position_ids, cache)

    def step_hidden_normed(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                           cache: KVCache | TTTCache) -> tuple[Tensor, Tensor]:
        """:meth:`step_hidden` and the draft head's input norm(hidden) [B, T, H], from the same kernels."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(embeds, hidden, position_ids, cache, self.norm)

    def logits(self, hidden_out: Tensor) -> Tensor:
        """Pre-norm hidden [.., H] → draft logits [.., draft_vocab]."""
        return self.lm_head(self.norm(hidden_out))

    def step(
        self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor, cache: KVCache | TTTCache | None = None
    ) -> tuple[Tensor, Tensor, KVCache | TTTCache]:
        """input_ids [B, T], hidden [B, T, H] → (hidden_out [B, T, H], logits [B, T, N], cache)."""
        cache = KVCache() if cache is None else cache
        out = self.step_hidden(input_ids, hidden, position_ids, cache)
        return out, self.logits(out), cache
