"""Batched speculative decoding gives, prompt for prompt, what one-at-a-time decoding gives."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from eagle3.drafter.caches import TTTCache
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.settings.drafter import DrafterSettings
from eagle3.evaluate.batched import BatchedSpeculativeDecoder, Slots
from eagle3.evaluate.spec_decode import SpeculativeDecoder, greedy_generate
from eagle3.targets.capture import HiddenCapture, find_decoder_stack
from eagle3.targets.aux_layers import default_aux_layer_ids

SEEN = 5  # prompts the drafter is trained on (memorised: long acceptances), then one it has not seen
LENGTH = 36  # prompt + greedy continuation, per training sequence
TTT_STEPS = 3


def prompt(seed, length):
    return torch.randint(0, 900, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def capture(target):
    layers = target.config.num_hidden_layers
    return HiddenCapture(find_decoder_stack(target, layers), default_aux_layer_ids(layers))


def drafter_trained_on_greedy(target, prompts, steps=50):
    """A real Eagle3Drafter fitted (TTT, 3 steps) to the target's greedy continuations of
    ``prompts``: on those prompts most drafts are accepted, elsewhere few, so acceptance
    lengths vary from 1 to k+1 within one batch. Draft vocab = target vocab (d2t zeros)."""
    seqs = torch.tensor([p + greedy_generate(target, p, LENGTH - len(p), set()) for p in prompts])  # [N, L]
    with capture(target) as cap, torch.no_grad():
        target(input_ids=seqs)
        aux = torch.cat(cap.pop()[0], dim=-1)  # [N, L, 3H]
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    vocab = target.config.vocab_size
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(target.config, DrafterSettings(), vocab, aux_ids))
    drafter.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    t = LENGTH - 1 - TTT_STEPS
    positions = torch.arange(t)[None].expand(len(prompts), t)
    for _ in range(steps):
        cache, loss = TTTCache(), 0.0
        hidden = drafter.project_aux(aux[:, :t])
        for j in range(TTT_STEPS):  # row t: token seq[t+1+j] predicts seq[t+2+j]
            hidden, logits, _ = drafter.step(seqs[:, 1 + j: 1 + j + t], hidden, positions + j, cache)
            loss = loss + F.cross_entropy(logits.flatten(0, 1), seqs[:, 2 + j: 2 + j + t].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval(), torch.zeros(vocab, dtype=torch.int64)


def batched_equals_one_at_a_time(target, drafter, d2t, prompts, k, max_new, eos=frozenset()):
    """Decode ``prompts`` batched and one at a time; assert equal results; return them."""
    with capture(target) as cap:
        one = SpeculativeDecoder(target, cap, drafter, d2t, k, set(eos))
        batched = BatchedSpeculativeDecoder(target, cap, drafter, d2t, k, set(eos))
        assert batched.fallback_reason is None
        expected = [one.generate(p, max_new) for p in prompts]
        assert batched.generate_batch(prompts, max_new) == expected
    return expected


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def setup(request, tiny_target_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir(request.param), dtype=torch.float32).eval()
    seen = [prompt(s, 4 + 5 * s) for s in range(SEEN)]  # lengths 4, 9, .., 24
    # Fitted short of memorising: partly accepted chains too, on both tiny targets.
    drafter, d2t = drafter_trained_on_greedy(target, seen, steps=30)
    return target, drafter, d2t, seen + [prompt(99, 11)]


@pytest.mark.parametrize("k", [1, 3])
def test_batch_gives_what_one_at_a_time_gives(setup, k):
    target, drafter, d2t, prompts = setup
    max_new = 24
    # An EOS that the third prompt's output reaches early, so rows finish at different rounds.
    eos = {greedy_generate(target, prompts[2], 6, set())[5]}
    expected = batched_equals_one_at_a_time(target, drafter, d2t, prompts, k, max_new, eos)
    lengths = [a for r in expected for a in r.accept_lengths]
    assert 1 in lengths and k + 1 in lengths, lengths  # rejected and fully accepted chains both exercised
    if k == 3:
        assert {2, 3} & set(lengths), lengths  # and partly accepted ones
    ended = [r.tokens[-1] in eos for r in expected]
    assert any(ended) and not all(ended)  # some rows stop at EOS, others at max_new_tokens
    assert len({r.steps for r in expected}) > 1


def test_rows_that_finish_after_the_prefill_and_a_single_prompt(setup):
    target, drafter, d2t, prompts = setup
    with capture(target) as cap:
        one = SpeculativeDecoder(target, cap, drafter, d2t, 3, set())
        batched = BatchedSpeculativeDecoder(target, cap, drafter, d2t, 3, set())
        assert batched.generate_batch(prompts[:3], 1) == [one.generate(p, 1) for p in prompts[:3]]
        assert batched.generate_batch(prompts[1:2], 9) == [one.generate(prompts[1], 9)]
        assert batched.generate_batch([], 9) == []


def test_eager_attention_takes_the_mask_too(tiny_target_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir("llama"), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    seen = [prompt(s, 4 + 5 * s) for s in range(3)]
    drafter, d2t = drafter_trained_on_greedy(target, seen, steps=40)
    expected = batched_equals_one_at_a_time(target, drafter, d2t, seen, 3, 16)
    assert max(a for r in expected for a in r.accept_lengths) > 1


def test_a_sliding_window_target_falls_back_to_one_at_a_time_and_decodes_past_the_window():
    # A window far shorter than prompt + output: rejected drafts are cropped after the window
    # filled, and the output must still be the target's plain greedy one (no-cache reference).
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=6, attn_implementation="sdpa")
    target = MistralForCausalLM(config).eval()
    aux_ids = default_aux_layer_ids(4)
    drafter = Eagle3Drafter(DrafterConfig.from_target(config, DrafterSettings(), 256, aux_ids)).eval()
    d2t = torch.zeros(256, dtype=torch.int64)
    prompts = [[t % 256 for t in prompt(s, 5 + s)] for s in range(3)]
    with capture(target) as cap:
        batched = BatchedSpeculativeDecoder(target, cap, drafter, d2t, 2, set())
        assert "sliding window 6" in batched.fallback_reason
        one = SpeculativeDecoder(target, cap, drafter, d2t, 2, set())
        expected = [one.generate(p, 12) for p in prompts]
        assert batched.generate_batch(prompts, 12) == expected
        with torch.no_grad():
            for p, r in zip(prompts, expected):
                ids = list(p)
                for _ in range(12):
                    ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                assert r.tokens == ids[len(p):]


def test_slots_mask_sees_valid_earlier_positions_and_itself():
    slots = Slots(2, torch.device("cpu"))
    # row 0: prompt of 3; row 1: prompt of 1 + 2 padding slots
    slots.append(torch.tensor([[True, True, True], [True, False, False]]), torch.tensor([[0, 1, 2], [0, 1, 2]]))
    slots.valid[0, 2] = False  # as a rejected draft would be
    mask = slots.append(torch.tensor([[True, True], [True, True]]), torch.tensor([[2, 3], [1, 2]]))  # [2, 1, 2, 5]
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, False, True, False], [True, True, False, True, True]]
    assert mask[1, 0].tolist() == [[True, False, False, True, False], [True, False, False, True, True]]
    assert slots.trailing_invalid() == 0
    slots.valid[:, 3:] = False
    assert slots.trailing_invalid() == 3  # column 2 is invalid in both rows too
