"""The whole DAG's preflight: bad settings a stage would fail on are refused before anything starts,
in one line, and nothing finished is touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.context import run_stage
from eagle3.errors import ConfigError
from eagle3.pipeline.preflight import check_run, stages_to_run
from eagle3.stages import ORDER
from eagle3.store import open_store
from tests.fabricated_upstream import commit_fabricated_generate


def _cfg(tmp_path: Path, tiny_cache_dir: Path, **over):
    return load_config(None, {"run_id": "p", "store.uri": f"file://{tmp_path}/store", "target.model": "builtin:tiny-llama",
                              "target.cache_dir": str(tiny_cache_dir), "vocab.draft_vocab_size": 64, **over})


def test_every_bad_setting_is_named_in_one_line(tmp_path: Path, tiny_cache_dir: Path) -> None:
    cfg = _cfg(tmp_path, tiny_cache_dir, **{"vocab.draft_vocab_size": 5000, "target.aux_layer_ids": [2, 3, 9],
                                            "target.vocab_size": 2048})
    with pytest.raises(ConfigError) as e:
        check_run(cfg, set(ORDER))
    msg = str(e.value)
    assert "\n" not in msg
    assert "vocab.draft_vocab_size=5000 exceeds the target's vocab size 1024" in msg
    assert "target.aux_layer_ids: aux layer ids [9] out of range for a target with 6 layers (0..5)" in msg
    assert "target.vocab_size is 2048 but the target config" in msg
    check_run(_cfg(tmp_path, tiny_cache_dir), set(ORDER))  # the same target, good settings: passes


def test_only_stages_that_will_run_are_checked(tmp_path: Path, tiny_cache_dir: Path) -> None:
    cfg = _cfg(tmp_path, tiny_cache_dir)
    store = open_store(cfg.store.uri)
    assert stages_to_run(cfg, store, set(ORDER), ()) == set(ORDER)
    commit_fabricated_generate(store, cfg, vocab_size=1024)
    run_stage(cfg, "vocab")
    assert stages_to_run(cfg, store, set(ORDER), ()) == {"extract", "train", "export", "evaluate"}
    assert stages_to_run(cfg, store, set(ORDER), ("vocab",)) == {"vocab", "extract", "train", "export", "evaluate"}
    bigger = _cfg(tmp_path, tiny_cache_dir, **{"vocab.draft_vocab_size": 128})
    assert stages_to_run(bigger, store, set(ORDER), ()) == {"vocab", "extract", "train", "export", "evaluate"}
    # a same-size byte flip in vocab's output: it must run again, so its settings are checked again
    from tests.committed import path_of

    f = path_of(store, "p", "vocab", "vocab_mapping.safetensors")
    data = bytearray(f.read_bytes())
    data[-3] ^= 1
    f.write_bytes(bytes(data))
    assert "vocab" in stages_to_run(cfg, store, set(ORDER), ())


def test_a_refused_rerun_leaves_the_finished_output_alone(tmp_path: Path, tiny_cache_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, tiny_cache_dir)
    store = open_store(cfg.store.uri)
    commit_fabricated_generate(store, cfg, vocab_size=1024)
    run_stage(cfg, "vocab")
    before = {k: store.get_bytes(k) for k in store.list("p/vocab")}
    config = tmp_path / "bad.yaml"
    config.write_text(f"run_id: p\nstore:\n  uri: {cfg.store.uri}\ntarget:\n  model: builtin:tiny-llama\n"
                      f"  cache_dir: {tiny_cache_dir}\nvocab:\n  draft_vocab_size: 5000\n")
    r = CliRunner().invoke(app, ["run", "stage", "vocab", "-c", str(config), "--force"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1].startswith("error: vocab.draft_vocab_size=5000 exceeds the target's vocab size 1024")
    assert {k: store.get_bytes(k) for k in store.list("p/vocab")} == before
    assert not store.exists("p/_run/lease.json"), "the lease is released on a refused run"


@pytest.mark.parametrize("endpoint, why", [
    ("localhost:8000/v1", "has no scheme: write http://localhost:8000/v1"),
    ("http://host:99999/v1", "port 99999 is out of range"),
    ("ftp://host/v1", "is not an http(s)://HOST[:PORT][/PATH] URL"),
])
def test_an_endpoint_url_of_the_wrong_shape_is_a_config_error(endpoint: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, {"serve.endpoint": endpoint})
    assert why in str(e.value) and "serve.endpoint" in str(e.value)


def _prompts_file(tmp_path: Path, data: bytes, name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("data, says", [
    (b"", "no prompts"),
    (b"\n  \n", "no prompts"),
    (b'{"prompt": "ok"}\nnot json\n{"prompt": ""}\n', "malformed lines 2, 3 (first: line 2: not JSON)"),
    (b'{"prompt": "ok"}\n\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR', "binary content (a NUL byte on line 4), not JSONL text"),
])
def test_a_prompts_file_that_does_not_parse_is_one_line(tmp_path: Path, tiny_cache_dir: Path, data: bytes, says: str) -> None:
    path = _prompts_file(tmp_path, data)
    cfg = _cfg(tmp_path, tiny_cache_dir, **{"generate.prompts": str(path)})
    with pytest.raises(ConfigError) as e:
        check_run(cfg, set(ORDER))
    assert str(e.value) == f"generate.prompts: {path}: {says}"


def test_prompts_are_counted(tmp_path: Path, tiny_cache_dir: Path) -> None:
    path = _prompts_file(tmp_path, b'{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    lines: list[str] = []
    check_run(_cfg(tmp_path, tiny_cache_dir, **{"generate.prompts": str(path), "evaluate.prompts": str(path)}),
              set(ORDER), lines.append)
    assert "preflight: generate.prompts: 2 prompts" in lines and "preflight: evaluate.prompts: 2 prompts" in lines


def test_a_huge_prompt_line_is_refused_without_tokenizing_it(tmp_path: Path, tiny_cache_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """20 MB on one line: the vocab's longest token bounds the count from below, no tokenizer is loaded."""
    huge = json.dumps({"prompt": "word " * 4_000_000}).encode()
    path = _prompts_file(tmp_path, b'{"prompt": "short"}\n' + huge + b"\n")

    def no_tokenizer(*a, **k):
        raise AssertionError("the tokenizer was loaded to count a prompt the byte bound already refuses")

    monkeypatch.setattr("eagle3.targets.load.load_tokenizer", no_tokenizer)
    with pytest.raises(ConfigError) as e:
        check_run(_cfg(tmp_path, tiny_cache_dir, **{"generate.prompts": str(path)}), set(ORDER))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"generate.prompts {path}: line 2 longer than generate.max_length=4096 tokens (line 2: at least ")


def test_a_prompt_over_max_length_is_counted_with_the_chat_template(tmp_path: Path, tiny_cache_dir: Path) -> None:
    from eagle3.generate.render import encode, generation_prompt
    from eagle3.targets.load import load_tokenizer

    words = " ".join(f"w{i}" for i in range(60))  # ~200 bytes: over max_length/2, so counted exactly
    lines = [{"prompt": "short"}, {"prompt": words}, {"prompt": "short again"}, {"prompt": words + " more"}]
    path = _prompts_file(tmp_path, "".join(json.dumps(x) + "\n" for x in lines).encode())
    cfg = _cfg(tmp_path, tiny_cache_dir, **{"generate.prompts": str(path), "generate.max_length": 128})
    tok = load_tokenizer(cfg.target)
    n = len(encode(tok, generation_prompt(tok, [{"role": "user", "content": words}])))
    assert n > 128
    with pytest.raises(ConfigError) as e:
        check_run(cfg, set(ORDER))
    assert f"lines 2, 4 longer than generate.max_length=128 tokens (line 2: {n} tokens with the chat template)" in str(e.value)
    check_run(cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"max_length": n + 8})}), set(ORDER))


def test_a_local_target_folder_must_exist_hold_a_config_and_a_tokenizer(tmp_path: Path, tiny_cache_dir: Path,
                                                                     tiny_llama_dir: Path) -> None:
    missing = tmp_path / "models" / "nope"
    with pytest.raises(ConfigError) as e:
        check_run(_cfg(tmp_path, tiny_cache_dir, **{"target.model": str(missing)}), set(ORDER))
    assert str(e.value) == f"target.model: no such folder: {missing}"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as e:
        check_run(_cfg(tmp_path, tiny_cache_dir, **{"target.model": str(empty)}), {"vocab"})
    assert str(e.value) == f"target.model: {empty} has no config.json (not a Hugging Face model folder)"
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        check_run(_cfg(tmp_path, tiny_cache_dir, **{"target.model": str(broken)}), set(ORDER))
    assert str(e.value).startswith(f"cannot load target tokenizer from {broken}")
    check_run(_cfg(tmp_path, tiny_cache_dir, **{"target.model": str(tiny_llama_dir)}), set(ORDER))


def test_bad_prompts_stop_the_run_before_the_server_starts(tmp_path: Path, tiny_cache_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = _prompts_file(tmp_path, b"\x00\x01binary")
    r = CliRunner().invoke(app, ["run", "pipeline", "--store", f"file://{tmp_path}/store", "--run-id", "p"],
                           env={"EAGLE3_GENERATE__PROMPTS": str(path), "EAGLE3_TARGET__CACHE_DIR": str(tiny_cache_dir),
                                "EAGLE3_VOCAB__DRAFT_VOCAB_SIZE": "64"})
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"error: generate.prompts: {path}: binary content (a NUL byte on line 1), not JSONL text"]
    assert not (tmp_path / "store" / "p" / "_run" / "state.json").exists(), "nothing started: no state record"
    assert not (tmp_path / ".eagle3" / "runs").exists(), "no run folder, no server log"
