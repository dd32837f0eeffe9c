"""The stage registry's declarations agree with what the stages write."""

from __future__ import annotations

from fnmatch import fnmatchcase

from eagle3.stages import ORDER, STAGES, required_objects


def test_required_objects_are_the_names_the_stages_write() -> None:
    from eagle3.generate.stage import METADATA, RAW, TOKEN_FREQ
    from eagle3.generate.tokenized import TOKENIZED
    from eagle3.drafter.adapter import CONFIG, WEIGHTS
    from eagle3.evaluate.stage import PLOT, REPORT
    from eagle3.export.directory import FILES
    from eagle3.extract.shards import INDEX, TARGET_HEAD, shard_name
    from eagle3.vocab.stage import COVERAGE_JSON, COVERAGE_PNG, VOCAB_MAPPING

    written = {
        "generate": {RAW, TOKENIZED, TOKEN_FREQ, METADATA},
        "vocab": {VOCAB_MAPPING, COVERAGE_JSON, COVERAGE_PNG},
        "extract": {INDEX, TARGET_HEAD, shard_name(0), shard_name(41)},
        "train": {WEIGHTS, CONFIG, "metrics.jsonl", "loss.png"},
        "export": set(FILES),
        "evaluate": {REPORT, PLOT},
    }
    assert set(written) == set(ORDER)
    for stage, names in written.items():
        required = required_objects(stage)
        assert required, stage
        for r in required:  # every declaration names something the stage writes...
            assert any(fnmatchcase(n, r.pattern) for n in names), (stage, r.pattern)
        for n in names:  # ...and everything it always writes is declared
            assert any(fnmatchcase(n, r.pattern) for r in required), (stage, n)
    shards = [r for r in required_objects("extract") if r.counted_by]
    assert [(r.pattern, r.counted_by) for r in shards] == [("shards/shard-*.safetensors", (INDEX, "shards"))]


def test_a_name_outside_the_registry_requires_nothing() -> None:
    assert required_objects("not-a-stage") == () and "not-a-stage" not in STAGES
