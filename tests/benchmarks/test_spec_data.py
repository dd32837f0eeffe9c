"""speculators' data from our samples (benchmarks/quality/spec_data.py): the extract stage's capture, its layout."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from eagle3.data.tokenized import from_lists
from tests.benchmarks.quality_modules import load


def test_hidden_states_are_the_aux_inputs_and_the_final_norms_input(tmp_path, tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 900, (n,), generator=g).tolist() for n in (13, 5, 9)]
    samples = from_lists([(i, r, [1] * len(r)) for i, r in enumerate(rows)])
    stats = load("spec_data").write_hidden_states(model, samples, [1, 3, 4], tmp_path, torch.device("cpu"),
                                                  batch_tokens=20)  # several batches
    assert (stats["samples"], stats["tokens"]) == (3, 27)
    for i, row in enumerate(rows):
        saved = load_file(str(tmp_path / f"hs_{i}.safetensors"))
        assert saved["token_ids"].tolist() == row
        assert saved["hidden_states"].shape == (len(row), 4, model.config.hidden_size)
        with torch.inference_mode():
            ref = model(torch.tensor([row]), output_hidden_states=True).hidden_states  # L+1 x [1, T, H]
            last = saved["hidden_states"][:, 3].float()
            torch.testing.assert_close(model.model.norm(last), ref[-1][0], atol=0.05, rtol=0.05)  # bf16 stored
        for j, k in enumerate([1, 3, 4]):
            torch.testing.assert_close(saved["hidden_states"][:, j], ref[k][0].to(torch.bfloat16), atol=1e-2, rtol=1e-2)
