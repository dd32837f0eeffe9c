"""``builtin:tiny-prompts``: a few hundred short, varied prompts generated deterministically.

They exercise all three input shapes (chat messages, ``{"prompt"}``, ShareGPT), system
turns and multi-turn conversations, so the demo and tests need no external data.

Every user turn is a :class:`Request` (a task about a topic in a style, or a sum). The
builtin tiny targets are pretrained on chats drawn from the same generator (another
seed), so their greedy answers to these prompts, and to any held-out ones, are regular.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

NUM_PROMPTS = 320

TASKS = ["Explain", "Summarize", "Write a haiku about", "List three facts about", "Give an example of",
         "Describe", "Compare two kinds of", "Write a short story about", "Ask a question about", "Define"]
TOPICS = ["the ocean", "prime numbers", "sorting algorithms", "the moon", "bread baking", "graph search",
          "autumn leaves", "a robot cat", "tea history", "the speed of light", "python functions", "rivers",
          "dragons", "compilers", "weather forecasts", "city maps"]
STYLES = ["", " in one sentence", " step by step", " for a child", " briefly", " with an example"]
SYSTEMS = ["You are a helpful assistant.", "Be concise.", "Think before you answer."]
FIRST_REPLY = "Sure, here it is."  # the earlier assistant turn of multi-turn prompts


@dataclass(frozen=True)
class Request:
    """One user turn: ``task topic style.``, or ``What is a plus b?`` when ``task`` is None."""

    task: str | None = None
    topic: str = ""
    style: str = ""
    a: int = 0
    b: int = 0

    @property
    def text(self) -> str:
        if self.task is None:
            return f"What is {self.a} plus {self.b}?"
        return f"{self.task} {self.topic}{self.style}."


def sample_request(rng: random.Random) -> Request:
    if rng.random() < 0.2:
        return Request(a=rng.randint(1, 999), b=rng.randint(1, 999))
    return Request(rng.choice(TASKS), rng.choice(TOPICS), rng.choice(STYLES))


def sample_conversation(rng: random.Random, i: int) -> tuple[dict, Request]:
    """The ``i``-th prompt record (shape cycles with ``i``) and the request it ends with."""
    shape = i % 4
    system = rng.choice(SYSTEMS) if shape == 1 else None
    req = sample_request(rng)
    if shape == 0:
        return {"prompt": req.text}, req
    if shape == 1:
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": req.text}]}, req
    if shape == 2:
        return {"conversations": [{"from": "human", "value": req.text}]}, req
    last = sample_request(rng)  # multi-turn: the target answers the last user turn
    return {"messages": [{"role": "user", "content": req.text},
                         {"role": "assistant", "content": FIRST_REPLY},
                         {"role": "user", "content": "Now " + last.text.lower()}]}, last


def builtin_prompt_records(n: int = NUM_PROMPTS, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [sample_conversation(rng, i)[0] for i in range(n)]


def builtin_prompts_jsonl() -> bytes:
    return "".join(json.dumps(r) + "\n" for r in builtin_prompt_records()).encode()
