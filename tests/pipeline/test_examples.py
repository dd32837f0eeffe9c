"""The example configs validate and say what the docs promise; `init` covers every setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle3.config import PipelineConfig, load_config
from eagle3.pipeline.init import config_template

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny-deepseek.yaml", "kimi-k2.5.yaml"])
def test_examples_validate(name):
    cfg = load_config(EXAMPLES / name)
    assert cfg.backend == "local"


def test_kimi_example_has_the_facts_right():
    cfg = load_config(EXAMPLES / "kimi-k2.5.yaml")
    assert cfg.target.aux_layer_ids == [2, 30, 58]
    assert cfg.vocab.draft_vocab_size == 32000
    assert cfg.serve.tensor_parallel_size == 8 and cfg.serve.reasoning_parser == "kimi_k2"
    assert cfg.kubernetes.gpus_per_node == 8 and cfg.store.uri.startswith("s3://")


def test_tiny_examples_differ_only_in_target_run_id_and_sample_counts():
    # The MoE target decodes several times slower on CPU, so its example generates and
    # evaluates fewer, shorter samples; everything else must stay in step.
    a = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    b = yaml.safe_load((EXAMPLES / "tiny-deepseek.yaml").read_text())
    assert (a["target"]["model"], b["target"]["model"]) == ("builtin:tiny-llama", "builtin:tiny-deepseek")
    for d in (a, b):
        d.pop("run_id"), d["target"].pop("model")
        assert "port" not in d["serve"]  # a free port each run: two tiny runs on one host never clash
        for section, key in [("generate", "max_samples"), ("generate", "max_tokens"),
                             ("evaluate", "num_prompts"), ("evaluate", "max_new_tokens")]:
            d[section].pop(key, None)
    assert a == b


def test_init_template_documents_every_field_and_loads_back():
    text = config_template()
    # every default, and run_id left unset: a run of the written file is named after it
    assert PipelineConfig(**yaml.safe_load(text)) == load_config(None).model_copy(update={"run_id": None})
    for section, info in PipelineConfig.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            assert f"\n{section}:\n" in text
            for name, field in sub.model_fields.items():
                assert f"\n  {name}:" in text, f"{section}.{name} missing"
                if field.description:
                    first_words = " ".join(field.description.split()[:3])
                    assert first_words in text, f"{section}.{name}: description missing"
