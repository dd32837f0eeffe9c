"""Teach a tiny target something: a short, deterministic pretraining on synthetic chats.

A random target's greedy text is noise, so a drafter trained on it learns nothing and
the demo's acceptance length stays 1. Instead the builtin targets are trained (a few
hundred steps, seconds on one CPU thread) on chats from the builtin prompt generator
(another seed) whose answers are templated: ``<think>`` reasoning that restates the
request, then an answer that depends on the task and names the topic. Their greedy
answers to the builtin prompts, and to held-out ones, are then regular text with
reasoning, which a drafter can learn to predict.
"""

from __future__ import annotations

import random

import torch

from eagle3.targets.builtin_prompts import FIRST_REPLY, SYSTEMS, Request, sample_request
from eagle3.targets.think import THINK_CLOSE, opens_think_block

PRETRAIN_STEPS = 120
PRETRAIN_BATCH = 8
PRETRAIN_LR = 1e-2
PRETRAIN_CHATS = 3000
PRETRAIN_SEED_OFFSET = 1000  # chats never coincide with builtin prompts (seed 0) by seed

# The answer to each task; {t} is the topic, {T} the topic capitalised.
ANSWERS = {
    "Explain": "{T} is easy to explain. It works one step at a time, and each step is small.",
    "Summarize": "In short, {t} is a big idea. The main points are simple and clear.",
    "Write a haiku about": "Quiet {t},\nunder the silver sky,\nthe day goes on.",
    "List three facts about": "Three facts about {t}: it is old, it is useful, and it is fun.",
    "Give an example of": "One example of {t} is a small one. It shows the main idea.",
    "Describe": "{T} is calm and clear. Many people like to talk about it.",
    "Compare two kinds of": "There are two kinds of {t}. The first is simple, and the second is more complex.",
    "Write a short story about": "Once upon a time there was {t}. It had a long day, and then it rested.",
    "Ask a question about": "Here is a question: what is the best part of {t}?",
    "Define": "{T} is a word for something we can study and use.",
}
STYLE_NOTES = {"": "a clear answer", " in one sentence": "one sentence", " step by step": "small steps",
               " for a child": "simple words", " briefly": "a short answer", " with an example": "an example"}


def reply(req: Request) -> tuple[str, str]:
    """(reasoning, content) of the templated answer to one request."""
    if req.task is None:
        return (f"The user wants the sum of {req.a} and {req.b}. I add them.", f"{req.a} plus {req.b} is {req.a + req.b}.")
    reasoning = f"The user wants me to {req.task.lower()} {req.topic}. They want {STYLE_NOTES[req.style]}."
    content = ANSWERS[req.task].format(t=req.topic, T=req.topic[0].upper() + req.topic[1:])
    return reasoning, content


def synthetic_chat(rng: random.Random) -> list[dict]:
    """A full conversation whose last assistant turn carries reasoning."""
    shape = rng.randrange(3)
    req = sample_request(rng)
    if shape == 0:
        messages = [{"role": "user", "content": req.text}]
    elif shape == 1:
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": req.text}]
    else:
        last = sample_request(rng)
        messages = [{"role": "user", "content": req.text}, {"role": "assistant", "content": FIRST_REPLY},
                    {"role": "user", "content": "Now " + last.text.lower()}]
        req = last
    reasoning, content = reply(req)
    return messages + [{"role": "assistant", "content": content, "reasoning_content": reasoning}]


def synthetic_chats(n: int = PRETRAIN_CHATS, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed + PRETRAIN_SEED_OFFSET)
    return [synthetic_chat(rng) for _ in range(n)]


def _examples(tokenizer, chats: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per chat; labels are -100 except on the final assistant turn."""
    out = []
    for chat in chats:
        head = tokenizer.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True)
        if opens_think_block(head):
            # Kimi-style: the prompt opens <think> and the template blanks a finished turn's
            # reasoning, so the reply is written as the target should generate it.
            last = chat[-1]
            reply = last["reasoning_content"] + THINK_CLOSE + last["content"] + "<|im_end|>"
        else:
            full = tokenizer.apply_chat_template(chat, tokenize=False)
            assert full.startswith(head)
            # The template ends the turn with "<|im_end|>\n": train up to and including <|im_end|>.
            reply = full[len(head):].rstrip("\n")
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        out.append((head_ids + reply_ids, [-100] * len(head_ids) + reply_ids))
    return out


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] input_ids and labels (causal attention never sees the padding)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, :len(x)] = torch.tensor(x)
        labels[row, :len(y)] = torch.tensor(y)
    return ids, labels


def _reply_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on labelled positions only (the lm_head skips the rest)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]  # [B, T-1, H]
    target = labels[:, 1:]  # [B, T-1]
    keep = target != -100
    logits = model.lm_head(hidden[keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits, target[keep])


def pretrain(model, tokenizer, seed: int = 0, steps: int = PRETRAIN_STEPS, chats: list[list[dict]] | None = None,
             batch: int = PRETRAIN_BATCH, lr: float = PRETRAIN_LR) -> list[float]:
    """Train ``model`` in place on ``chats`` (default: the synthetic ones) for ``steps`` batches of ``batch``,
    on the model's device, teaching each chat's final assistant turn.

    On CPU: deterministic, on one thread (the tiny targets' builds are byte-identical), restoring the caller's
    thread count and determinism mode. On CUDA: bfloat16 autocast (a larger target, trained in minutes).
    Returns the loss per step.
    """
    device = next(model.parameters()).device
    cpu = device.type == "cpu"
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if cpu:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(seed)
        examples = _examples(tokenizer, synthetic_chats(seed=seed) if chats is None else chats)
        order = random.Random(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
        model.train()
        losses = []
        for _ in range(steps):
            ids, labels = (t.to(device) for t in _batch(order.sample(examples, batch), tokenizer.pad_token_id))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = _reply_loss(model, ids, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        model.eval()
        return losses
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
