"""Prompt inputs: three JSONL shapes, stable ids, one error line naming malformed lines."""

from __future__ import annotations

import json

import pytest

from eagle3.targets.builtin_prompts import NUM_PROMPTS
from eagle3.generate.prompts import load_prompts, parse_prompts, select_prompts
from eagle3.errors import StageError


def _jsonl(*objs) -> bytes:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs).encode()


def test_three_shapes_and_blank_lines():
    data = _jsonl(
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]},
        "",
        {"prompt": "b"},
        {"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "r"},
                           {"from": "human", "value": "d"}, {"from": "gpt", "value": "dropped"}]},
    )
    ps = parse_prompts(data, "p.jsonl")
    assert [p.sample_id for p in ps] == [0, 1, 2]
    assert ps[0].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]
    assert ps[1].messages == [{"role": "user", "content": "b"}]
    # The target answers the last user turn; the trailing assistant turn is not part of the prompt.
    assert ps[2].messages == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "r"},
                              {"role": "user", "content": "d"}]


def test_system_prompt_added_only_where_missing():
    data = _jsonl({"prompt": "a"}, {"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "b"}]})
    ps = parse_prompts(data, "p.jsonl", system_prompt="SYS")
    assert ps[0].messages[0] == {"role": "system", "content": "SYS"}
    assert ps[1].messages[0] == {"role": "system", "content": "mine"}


def test_malformed_lines_in_one_error_line():
    data = _jsonl({"prompt": "ok"}, "not json", [1, 2], {"messages": [{"role": "assistant", "content": "x"}]},
                  {"other": 1}, {"prompt": ""})
    data += b"\xff\xfe\n"
    with pytest.raises(StageError) as e:
        parse_prompts(data, "prompts.jsonl")
    assert str(e.value) == "prompts.jsonl: malformed lines 2, 3, 4, 5, 6, 7 (first: line 2: not JSON)"


def test_many_malformed_lines_are_abbreviated():
    with pytest.raises(StageError, match=r"malformed lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 \(\+5 more\)"):
        parse_prompts(b"x\n" * 15, "p.jsonl")


def test_empty_file():
    with pytest.raises(StageError, match="p.jsonl: no prompts"):
        parse_prompts(b"\n\n", "p.jsonl")


def test_missing_file(tmp_path):
    with pytest.raises(StageError, match="prompts file not found"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_builtin_prompts_are_deterministic_and_varied():
    a, b = load_prompts("builtin:tiny-prompts"), load_prompts("builtin:tiny-prompts")
    assert a == b and len(a) == NUM_PROMPTS
    assert len({p.messages[-1]["content"] for p in a}) > NUM_PROMPTS // 2
    assert {len(p.messages) for p in a} == {1, 2, 3}


def test_select_keeps_ids_and_order():
    ps = load_prompts("builtin:tiny-prompts")
    chosen = select_prompts(ps, 10, seed=1)
    ids = [p.sample_id for p in chosen]
    assert len(ids) == 10 and ids == sorted(ids)
    assert select_prompts(ps, 10, seed=1) == chosen and select_prompts(ps, 10, seed=2) != chosen
    assert all(ps[p.sample_id] == p for p in chosen)
