"""Check that speculators' EAGLE-3 drafter, configured as spec_train.py configures it, is
the same function as ours once its checkpoint is converted by ``export_ours``.

Builds speculators' drafter for a target (its own ``--dry-run``: initialized weights, no
training, CPU is enough), perturbs every norm weight so they matter, converts it to our
export format, loads that with ``eagle3.drafter.adapter.load_drafter`` and compares the
draft logits of one drafter step on random aux hidden states and tokens.

    PYTHONPATH=<speculators site>:. python benchmarks/quality/check_equivalence.py --target DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import save_file
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig
    from transformers import AutoConfig, DynamicCache

    from eagle3.drafter.adapter import load_drafter
    from eagle3.export.vllm_config import drafter_config_from_export
    from eagle3.targets.aux_layers import default_aux_layer_ids
    from spec_train import export_ours, spec_argv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft-vocab-size", type=int, default=256)
    a = ap.parse_args(argv)
    tcfg = AutoConfig.from_pretrained(a.target)
    aux = default_aux_layer_ids(tcfg.num_hidden_layers)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data"
        data.mkdir()
        import numpy as np

        d2t = torch.zeros(a.draft_vocab_size, dtype=torch.int64)  # draft id i = target id i
        t2d = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
        t2d[: a.draft_vocab_size] = True
        np.save(data / f"d2t-{a.draft_vocab_size}.npy", d2t.numpy())
        np.save(data / f"t2d-{a.draft_vocab_size}.npy", t2d.numpy())
        ns = argparse.Namespace(target=a.target, data=data, save=tmp / "spec", draft_vocab_size=a.draft_vocab_size,
                                aux_layer_ids=aux, ttt_steps=7, ttt_decay=0.8, lr=5e-4, warmup_steps=1, epochs=1,
                                total_seq_len=1024, train_ratio=0.9, num_workers=0, log_freq=1,
                                extra=["--draft-attn-impl", "sdpa", "--dry-run"])
        spec_main(TrainConfig.resolve(spec_argv(ns)))
        cfg = Eagle3DraftModel.config_class.from_pretrained(tmp / "spec")
        cfg.transformer_layer_config._attn_implementation = "sdpa"
        theirs = Eagle3DraftModel(cfg)
        from safetensors.torch import load_file

        theirs.load_state_dict(load_file(str(tmp / "spec" / "model.safetensors")), strict=False)
        theirs = theirs.float().eval()
        with torch.no_grad():  # norms initialised to ones would hide a missing or misplaced norm
            for name, p in theirs.named_parameters():
                if "norm" in name and "verifier" not in name:
                    p.copy_(1 + 0.3 * torch.randn_like(p))
        state = {k: v.to(torch.bfloat16) for k, v in theirs.state_dict().items()}
        (tmp / "ckpt").mkdir()
        save_file(state, str(tmp / "ckpt" / "model.safetensors"))
        (tmp / "ckpt" / "config.json").write_text((tmp / "spec" / "config.json").read_text())
        export_ours(tmp / "ckpt", a.target, aux, tmp / "export")
        theirs.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)  # same bf16 rounding
        dcfg = drafter_config_from_export(json.loads((tmp / "export" / "config.json").read_text()))
        ours = load_drafter(tmp / "export", theirs.embed_tokens.weight.float(), dcfg).float().eval()

        t = 16
        ids = torch.randint(0, tcfg.vocab_size, (1, t))
        aux_h = torch.randn(1, t, 3 * tcfg.hidden_size)
        pos = torch.arange(t)[None]
        with torch.no_grad():
            h = theirs.fc(aux_h)
            x = torch.cat([theirs.embed_tokens(ids), h], -1)
            out = theirs.layers[0](x, attention_mask=None, position_ids=pos, past_key_values=DynamicCache(),
                                   cache_position=torch.arange(t), position_embeddings=theirs.rotary_emb(x, pos))
            out = out[0] if isinstance(out, tuple) else out
            ref = theirs.lm_head(theirs.norm(out))  # [1, T, draft_vocab]
            _, got, _ = ours.step(ids, ours.project_aux(aux_h), pos)
    diff = (ref - got).abs().max().item()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(json.dumps({"max_abs_logit_diff": diff, "logit_scale": ref.abs().max().item(), "argmax_agreement": agree}))
    return 0 if diff < 1e-4 * max(1.0, ref.abs().max().item()) else 1


if __name__ == "__main__":
    sys.exit(main())
