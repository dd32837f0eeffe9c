"""Local files a config names reach stages that cannot see this disk: uploaded to the run's
store under their sha256, and the config the pods get names the object."""

from __future__ import annotations

import pytest

from eagle3.config import load_config
from eagle3.generate.prompts import read_prompts_bytes
from eagle3.errors import ConfigError
from eagle3.k8s.inputs import input_digest, local_inputs, upload_inputs, with_inputs
from eagle3.store import open_store

PROMPTS = b'{"prompt": "hello"}\n{"prompt": "how are you?"}\n'


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "my prompts.jsonl"
    p.write_bytes(PROMPTS)
    return p


def cfg_for(store_uri: str, prompts, **extra):
    return load_config(None, {"run_id": "r1", "store.uri": store_uri, "generate.prompts": str(prompts), **extra})


def test_a_local_prompts_file_goes_to_the_store_and_the_pods_read_it_there(tmp_path, prompts):
    import hashlib

    store_uri = f"file://{tmp_path}/store"
    cfg = cfg_for(store_uri, prompts)
    [item] = local_inputs(cfg)
    sha = hashlib.sha256(PROMPTS).hexdigest()
    assert item.field == "generate.prompts" and item.sha256 == sha and item.size == len(PROMPTS)
    assert item.key == f"r1/inputs/{sha}/my_prompts.jsonl"  # a safe object key
    store = open_store(store_uri)
    [line] = upload_inputs(store, [item])
    assert line.startswith(f"generate.prompts: uploaded {prompts}") and item.uri in line
    assert store.get_bytes(item.key) == PROMPTS
    assert upload_inputs(store, [item])[0].endswith(f"is in the store already ({item.uri})")  # same content: once
    pod_cfg = with_inputs(cfg, [item])
    assert pod_cfg.generate.prompts == f"{store_uri}/{item.key}" and cfg.generate.prompts == str(prompts)
    assert read_prompts_bytes(pod_cfg.generate.prompts) == PROMPTS  # what generate (and evaluate) read in the pod
    # the same digest for the local file and its copy: an input key over content is unchanged by the upload
    assert input_digest(cfg.generate.prompts) == input_digest(pod_cfg.generate.prompts) == sha


def test_changed_content_lands_at_a_new_key(tmp_path, prompts):
    cfg = cfg_for(f"file://{tmp_path}/store", prompts)
    first = local_inputs(cfg)[0]
    prompts.write_bytes(PROMPTS + b'{"prompt": "one more"}\n')
    second = local_inputs(cfg)[0]
    assert first.key != second.key and input_digest(str(prompts)) == second.sha256


def test_evaluate_prompts_are_uploaded_too_and_builtin_or_s3_are_left_alone(tmp_path, prompts):
    held_out = tmp_path / "held.jsonl"
    held_out.write_bytes(b'{"prompt": "held out"}\n')
    cfg = cfg_for(f"file://{tmp_path}/store", prompts, **{"evaluate.prompts": str(held_out)})
    assert [i.field for i in local_inputs(cfg)] == ["generate.prompts", "evaluate.prompts"]
    for value in ("builtin:tiny-prompts", "s3://bucket/prompts.jsonl"):
        assert local_inputs(cfg_for(f"file://{tmp_path}/store", value)) == []
        assert input_digest(value) is None


def test_a_missing_local_file_is_a_config_error_naming_the_field(tmp_path):
    cfg = cfg_for(f"file://{tmp_path}/store", tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=r"^generate.prompts: file not found: .*nope.jsonl") as e:
        local_inputs(cfg)
    assert e.value.exit_code == 2
    assert local_inputs(cfg, missing_ok=True) == []


@pytest.mark.s3
def test_upload_to_s3_and_read_back_as_the_pods_do(s3_store_uri, prompts):
    cfg = cfg_for(s3_store_uri, prompts)
    items = local_inputs(cfg)
    upload_inputs(open_store(s3_store_uri), items)
    uri = with_inputs(cfg, items).generate.prompts
    assert uri.startswith(s3_store_uri + "/r1/inputs/")
    assert read_prompts_bytes(uri) == PROMPTS


def test_the_upload_does_not_change_the_generate_input_key(tmp_path, prompts):
    from eagle3.contract import stage_input_key
    from eagle3.stages import STAGES

    cfg = cfg_for(f"file://{tmp_path}/store", prompts)
    pod_cfg = with_inputs(cfg, local_inputs(cfg))
    assert stage_input_key(cfg, STAGES["generate"], {}) == stage_input_key(pod_cfg, STAGES["generate"], {})
