"""Prompt inputs: JSONL in three shapes, parsed into chat messages ending with a user turn.

Accepted lines (blank lines are skipped):

- ``{"messages": [{"role": "user", "content": "..."}, ...]}``  (OpenAI chat)
- ``{"prompt": "..."}``                                         (one user turn)
- ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` (ShareGPT)

The target answers the conversation up to its last user turn; later turns are dropped.
Every malformed line is reported at once, by line number, in one error line.
Sample ids are the 0-based positions of the prompts in the file: stable across reruns.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import StageError

BUILTIN_PROMPTS = "builtin:tiny-prompts"
MAX_LINES_NAMED = 10
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                   "bard": "assistant", "model": "assistant", "system": "system"}
_CHAT_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class Prompt:
    sample_id: int
    messages: list[dict[str, str]]
    line: int = 0  # 1-based line of the prompts file (0: not read from a file)


class MalformedLine(ValueError):
    """Why one line is not a prompt (the message names the problem, not the line)."""


def _turns_to_prompt(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    if last_user is None:
        raise MalformedLine("no user turn")
    return turns[: last_user + 1]


def _chat_messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise MalformedLine('"messages" is not a non-empty list')
    turns = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES:
            raise MalformedLine("a message has no role system/user/assistant")
        if not isinstance(m.get("content"), str):
            raise MalformedLine("a message content is not a string")
        turns.append({"role": m["role"], "content": m["content"]})
    return turns


def _sharegpt_messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise MalformedLine('"conversations" is not a non-empty list')
    turns = []
    for t in raw:
        if not isinstance(t, dict) or str(t.get("from", "")).lower() not in _SHAREGPT_ROLES:
            raise MalformedLine('a conversation turn has no "from" human/gpt/system')
        if not isinstance(t.get("value"), str):
            raise MalformedLine('a conversation turn "value" is not a string')
        turns.append({"role": _SHAREGPT_ROLES[str(t["from"]).lower()], "content": t["value"]})
    return turns


def parse_line(line: str) -> list[dict[str, str]]:
    """One JSONL line → chat messages ending with a user turn; raises MalformedLine."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise MalformedLine("not JSON") from None
    if not isinstance(obj, dict):
        raise MalformedLine("not a JSON object")
    if "messages" in obj:
        turns = _chat_messages(obj["messages"])
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise MalformedLine('"prompt" is not a non-empty string')
        turns = [{"role": "user", "content": obj["prompt"]}]
    elif "conversations" in obj:
        turns = _sharegpt_messages(obj["conversations"])
    else:
        raise MalformedLine('no "messages", "prompt" or "conversations"')
    turns = _turns_to_prompt(turns)
    if not turns[-1]["content"].strip():
        raise MalformedLine("the last user turn is empty")
    return turns


def parse_prompts(data: bytes, source: str, system_prompt: str | None = None) -> list[Prompt]:
    """All prompts of a JSONL file; one StageError naming every malformed line."""
    nul = data.find(b"\0")
    if nul >= 0:  # an archive, a tensor file, UTF-16 text: not one line of it would parse
        line = data.count(b"\n", 0, nul) + 1
        raise StageError(f"{source}: binary content (a NUL byte on line {line}), not JSONL text")
    prompts: list[Prompt] = []
    bad: list[tuple[int, str]] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            messages = parse_line(raw.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append((lineno, "not UTF-8"))
            continue
        except MalformedLine as e:
            bad.append((lineno, str(e)))
            continue
        if system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        prompts.append(Prompt(len(prompts), messages, lineno))
    if bad:
        named = ", ".join(str(n) for n, _ in bad[:MAX_LINES_NAMED])
        more = f" (+{len(bad) - MAX_LINES_NAMED} more)" if len(bad) > MAX_LINES_NAMED else ""
        raise StageError(f"{source}: malformed lines {named}{more} (first: line {bad[0][0]}: {bad[0][1]})")
    if not prompts:
        raise StageError(f"{source}: no prompts")
    return prompts


def read_prompts_bytes(spec: str, endpoint_url: str | None = None, region: str | None = None) -> bytes:
    """The bytes of a prompts file: builtin, local path, or s3://bucket/key."""
    if spec == BUILTIN_PROMPTS:
        from eagle3.targets.builtin_prompts import builtin_prompts_jsonl

        return builtin_prompts_jsonl()
    if spec.startswith("s3://"):
        from eagle3.store import open_store

        bucket, _, key = spec[len("s3://"):].partition("/")
        if not bucket or not key:
            raise StageError(f"prompts URI {spec!r} must be s3://BUCKET/KEY")
        return open_store(f"s3://{bucket}", endpoint_url, region).get_bytes(key)
    path = Path(spec[len("file://"):] if spec.startswith("file://") else spec).expanduser()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StageError(f"prompts file not found: {path}") from None
    except OSError as e:
        raise StageError(f"cannot read prompts file {path}: {e.strerror}") from None


def select_prompts(prompts: list[Prompt], max_samples: int | None, seed: int) -> list[Prompt]:
    """At most ``max_samples`` prompts, a seeded random subset kept in file order (ids unchanged)."""
    if max_samples is None or max_samples >= len(prompts):
        return prompts
    chosen = sorted(random.Random(seed).sample(range(len(prompts)), max_samples))
    return [prompts[i] for i in chosen]


def load_prompts(spec: str, system_prompt: str | None = None, max_samples: int | None = None, seed: int = 0,
                 endpoint_url: str | None = None, region: str | None = None) -> list[Prompt]:
    prompts = parse_prompts(read_prompts_bytes(spec, endpoint_url, region), spec, system_prompt)
    return select_prompts(prompts, max_samples, seed)


def iter_jsonl(lines: Iterable[bytes]) -> Iterable[dict[str, Any]]:
    for raw in lines:
        if raw.strip():
            yield json.loads(raw)
