"""The generate stage end to end: real `transformers serve` running tiny targets, real HTTP.

Cost on 2 shared cores is dominated by starting interpreters that import torch and by the
servers, so: one ``transformers serve`` per architecture for the whole session
(``tiny_server``); bad inputs that need no server run ``eagle3 stage generate`` through the
same typer app in-process (:func:`run_cli_in_process`); the real ``eagle3`` executable runs
for the kill-and-resume test (the process that is SIGKILLed) and for one bad input, which
proves stderr is exactly one line with nothing else printed by the libraries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from eagle3.cli.stage import app as stage_app
from eagle3.config import load_config
from eagle3.context import run_stage
from eagle3.generate.stage import RAW, deep_check
from eagle3.generate.tokenized import read_tokenized
from eagle3.manifest import verify_stage
from eagle3.store import open_store
from eagle3.manifest import attempt_root
from eagle3.store.local import LocalStore
from tests.committed import path_of
from tests.fixtures_targets import free_port
from tests.waiting import until

EAGLE3 = str(Path(sys.executable).parent / "eagle3")
N_PROMPTS = 8


def write_config(tmp_path: Path, target_dir: Path, **generate) -> Path:
    cfg = {
        "run_id": "gen",
        "store": {"uri": f"file://{tmp_path / 'store'}"},
        "target": {"model": str(target_dir)},
        "generate": {"max_samples": N_PROMPTS, "max_tokens": 4, "concurrency": 3, "part_size": 2,
                     "drop_truncated": False, **generate},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(config: Path, endpoint: str) -> subprocess.CompletedProcess:
    return subprocess.run([EAGLE3, "stage", "generate", "-c", str(config), "--endpoint", endpoint],
                          capture_output=True, text=True, env={**os.environ, "EAGLE3_API_KEY": ""})


class CliResult:
    """What the bad-input assertions read, from either a real subprocess or an in-process run."""

    def __init__(self, returncode: int, stderr: str) -> None:
        self.returncode, self.stderr = returncode, stderr


def run_cli_in_process(config: Path, endpoint: str | None) -> CliResult:
    """``eagle3 stage generate`` through the same typer app, without a new interpreter (no torch import)."""
    args = ["stage", "generate", "-c", str(config)] + (["--endpoint", endpoint] if endpoint else [])
    r = CliRunner().invoke(stage_app, args, env={"EAGLE3_API_KEY": None, "OPENAI_API_KEY": None})
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # no unexpected error
    return CliResult(r.exit_code, r.stderr)


def stage_key(cfg) -> str:
    """generate's input key, as the stage computes it (its attempt folder is named after it)."""
    from eagle3.contract import stage_input_key
    from eagle3.stages import STAGES

    return stage_input_key(cfg, STAGES["generate"], {}, open_store(cfg.store.uri))


def committed_file(store: Path, name: str) -> Path:
    return path_of(LocalStore(store), "gen", "generate", name)


def read_raw(store: Path) -> list[dict]:
    return [json.loads(line) for line in committed_file(store, RAW).read_text().splitlines()]


def assert_one_error_line(proc: subprocess.CompletedProcess | CliResult, *fragments: str) -> str:
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_generate_against_transformers_serve(arch, tiny_server, tmp_path):
    served = tiny_server(arch)
    cfg = load_config(write_config(tmp_path, served.target_dir))
    stats = run_stage(cfg, "generate", endpoint=served.base_url)
    assert stats["requested"] == stats["succeeded"] == stats["kept"] == N_PROMPTS and stats["failed"] == 0
    assert stats["assistant_tokens"] > 0 and stats["target_vocab_size"] == 1024
    store = tmp_path / "store"
    records = read_raw(store)
    assert len({r["id"] for r in records}) == N_PROMPTS
    assert all(r["usage"]["completion_tokens"] <= 4 for r in records)
    data = read_tokenized(committed_file(store, "tokenized.safetensors"))
    assert sorted(data.sample_ids.tolist()) == sorted(r["id"] for r in records)
    v = verify_stage(open_store(cfg.store.uri), "gen", "generate", deep=True, content_check=deep_check)
    assert v.complete, v.problems
    assert not list((store / "gen" / "generate").rglob("part-*"))  # merged, then dropped


def kill_once_parts_are_journaled(config: Path, endpoint: str, parts: int) -> Path:
    """Run ``eagle3 stage generate`` and SIGKILL it once ``parts`` parts are journaled; the attempt folder."""
    folder = Path(load_config(config).store.uri.removeprefix("file://")) / "gen" / "generate" / attempt_root(
        stage_key(load_config(config)), None)
    journal = folder / "_journal" / "parts"  # a part counts once its journal entry exists (written just after it)
    proc = subprocess.Popen([EAGLE3, "stage", "generate", "-c", str(config), "--endpoint", endpoint],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # killed once the parts are journaled, however long that takes
        assert until(lambda: len(list(journal.glob("part-*.jsonl.json"))) >= parts, proc), \
            f"generate ended before {parts} parts"
        assert proc.poll() is None, "generate finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    return folder


@pytest.mark.slow
def test_killed_generate_resumes_without_loss_or_duplicates(tiny_server, tmp_path):
    served = tiny_server("llama")
    config = write_config(tmp_path, served.target_dir, part_size=1, concurrency=1)
    folder = kill_once_parts_are_journaled(config, served.base_url, 3)
    committed = len(list((folder / "_journal" / "parts").glob("part-*.jsonl.json")))
    assert 3 <= committed < N_PROMPTS
    stats = run_stage(load_config(config), "generate", endpoint=served.base_url)  # the rerun: same code the CLI runs
    assert stats["requested"] == N_PROMPTS
    records = read_raw(tmp_path / "store")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == N_PROMPTS
    meta = json.loads(committed_file(tmp_path / "store", "metadata.json").read_text())
    assert meta["resumed"] >= committed and meta["resumed"] + meta["generated_this_attempt"] == N_PROMPTS
    data = read_tokenized(committed_file(tmp_path / "store", "tokenized.safetensors"))
    assert sorted(data.sample_ids.tolist()) == sorted(ids)


def one_character_changed(text: str) -> str:
    """``text`` with its first character replaced by a neighbour of the same UTF-8 size (a same-size edit)."""
    for i, c in enumerate(text):
        for d in (chr(ord(c) ^ 1), chr(ord(c) ^ 2)):
            if d.isprintable() and d not in '"\\' and len(d.encode()) == len(c.encode()):
                return text[:i] + d + text[i + 1:]
    raise AssertionError(f"no character of {text!r} to change")


@pytest.mark.slow
def test_a_journaled_part_edited_in_place_is_discarded_and_requested_again(tiny_server, tmp_path, capfd):
    served = tiny_server("llama")
    config = write_config(tmp_path, served.target_dir, part_size=1, concurrency=1)
    folder = kill_once_parts_are_journaled(config, served.base_url, 2)
    part = folder / "parts" / "part-000000.jsonl"
    record = json.loads(part.read_text())
    # the response's text: its content, or the reasoning the server split off
    text = next(v for k, v in record["response"].items() if k != "role" and isinstance(v, str) and v)
    size = part.stat().st_size
    edited = json.dumps(one_character_changed(text), ensure_ascii=False)
    part.write_text(part.read_text().replace(json.dumps(text, ensure_ascii=False), edited))
    assert edited in part.read_text() and part.stat().st_size == size
    journaled = len(list((folder / "_journal" / "parts").glob("part-*.jsonl.json")))
    capfd.readouterr()
    stats = run_stage(load_config(config), "generate", endpoint=served.base_url)
    said = [ln for ln in capfd.readouterr().err.splitlines() if "discarded" in ln]
    assert said == [f"generate: discarded parts/part-000000.jsonl of the interrupted attempt (corrupted object "
                    f"file://{folder}/parts/part-000000.jsonl: sha256 differs from the journal); "
                    "its work is done again"]
    records = {r["id"]: r for r in read_raw(tmp_path / "store")}
    assert len(records) == N_PROMPTS and edited not in json.dumps(records[record["id"]], ensure_ascii=False)
    assert stats["resumed"] == journaled - 1 and stats["generated_this_attempt"] == N_PROMPTS - journaled + 1
    v = verify_stage(open_store(load_config(config).store.uri), "gen", "generate", deep=True, content_check=deep_check)
    assert v.complete, v.problems


def test_malformed_prompts_file(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\nnot json\n{"prompt": "fine"}\n{"messages": []}\n')
    proc = run_cli_in_process(write_config(tmp_path, tiny_llama_dir, prompts=str(prompts)), "http://127.0.0.1:9/v1")
    assert_one_error_line(proc, "prompts.jsonl: malformed lines 2, 4 (first: line 2: not JSON)")


@pytest.mark.slow
def test_unreachable_endpoint(tiny_llama_dir, tmp_path):
    """The real executable: its whole stderr is the one error line (no library warnings, no traceback)."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = run_cli(write_config(tmp_path, tiny_llama_dir), url)
    assert_one_error_line(proc, "endpoint unreachable", url)


def test_tokenizer_vocab_does_not_match_target(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.add_tokens([f"<extra_{i}>" for i in range(100)])
    tok.save_pretrained(tmp_path / "other-tokenizer")
    config = write_config(tmp_path, tiny_llama_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["target"]["tokenizer"] = str(tmp_path / "other-tokenizer")
    config.write_text(yaml.safe_dump(cfg))
    proc = run_cli_in_process(config, "http://127.0.0.1:9/v1")
    assert_one_error_line(proc, "other-tokenizer has 1102 tokens but target vocab_size is 1024")


class AuthRequiredEndpoint(BaseHTTPRequestHandler):
    """Test double: an endpoint that rejects every request's credentials with 401."""

    def _reject(self) -> None:
        body = json.dumps({"error": {"message": "Invalid API key"}}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reject

    def log_message(self, *args) -> None:
        pass


def test_wrong_credentials(tiny_llama_dir, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), AuthRequiredEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        proc = run_cli_in_process(write_config(tmp_path, tiny_llama_dir), url)
    finally:
        server.shutdown()
    assert_one_error_line(proc, "rejected the credentials", "HTTP 401: Invalid API key")


def test_no_endpoint(tiny_llama_dir, tmp_path):
    proc = run_cli_in_process(write_config(tmp_path, tiny_llama_dir), None)
    assert_one_error_line(proc, "generate needs an endpoint")
