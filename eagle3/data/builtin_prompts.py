"""``builtin:tiny-prompts``: a few hundred short, varied prompts generated deterministically.

They exercise all three input shapes (chat messages, ``{"prompt"}``, ShareGPT), system
turns and multi-turn conversations, so the demo and tests need no external data.
"""

from __future__ import annotations

import json
import random

NUM_PROMPTS = 320

_TASKS = ["Explain", "Summarize", "Write a haiku about", "List three facts about", "Give an example of",
          "Describe", "Compare two kinds of", "Write a short story about", "Ask a question about", "Define"]
_TOPICS = ["the ocean", "prime numbers", "sorting algorithms", "the moon", "bread baking", "graph search",
           "autumn leaves", "a robot cat", "tea history", "the speed of light", "python functions", "rivers",
           "dragons", "compilers", "weather forecasts", "city maps"]
_STYLES = ["", " in one sentence", " step by step", " for a child", " briefly", " with an example"]
_SYSTEMS = ["You are a helpful assistant.", "Be concise.", "Think before you answer."]


def _text(rng: random.Random) -> str:
    if rng.random() < 0.2:
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        return f"What is {a} plus {b}?"
    return f"{rng.choice(_TASKS)} {rng.choice(_TOPICS)}{rng.choice(_STYLES)}."


def builtin_prompt_records(n: int = NUM_PROMPTS, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        shape = i % 4
        if shape == 0:
            records.append({"prompt": _text(rng)})
        elif shape == 1:
            records.append({"messages": [{"role": "system", "content": rng.choice(_SYSTEMS)},
                                         {"role": "user", "content": _text(rng)}]})
        elif shape == 2:
            records.append({"conversations": [{"from": "human", "value": _text(rng)}]})
        else:  # multi-turn: the target answers the last user turn
            records.append({"messages": [{"role": "user", "content": _text(rng)},
                                         {"role": "assistant", "content": "Sure, here it is."},
                                         {"role": "user", "content": "Now " + _text(rng).lower()}]})
    return records


def builtin_prompts_jsonl() -> bytes:
    return "".join(json.dumps(r) + "\n" for r in builtin_prompt_records()).encode()
