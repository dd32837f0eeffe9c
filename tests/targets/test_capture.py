import pytest
import torch

from eagle3.extract.batching import right_pad
from eagle3.targets.capture import HiddenCapture, find_decoder_stack
from eagle3.targets.aux_layers import default_aux_layer_ids


def test_hooks_equal_output_hidden_states(tiny_target):
    arch, model = tiny_target
    n_layers = model.config.num_hidden_layers
    aux_ids = default_aux_layer_ids(n_layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    with torch.inference_mode():
        ref = model(ids, output_hidden_states=True).hidden_states  # L+1 x [B, T, H]
    assert len(ref) == n_layers + 1
    stack = find_decoder_stack(model, n_layers)
    with HiddenCapture(stack, aux_ids) as capture:
        aux, final = capture.run_stack(ids)
    for k, got in zip(aux_ids, aux):
        assert torch.equal(got, ref[k]), f"{arch}: aux layer {k} differs from hidden_states[{k}]"
    assert torch.equal(final, ref[-1]), f"{arch}: final hidden differs from hidden_states[-1] (after the norm)"
    # And the teacher logits follow from the stored final state.
    with torch.inference_mode():
        logits = model(ids).logits
        torch.testing.assert_close(model.get_output_embeddings()(final), logits)


def test_the_final_norms_input_on_request(tiny_target):
    """final_normed=False: the last decoder layer's output, as vLLM's hidden-states connector gives it."""
    _, model = tiny_target
    stack = find_decoder_stack(model, model.config.num_hidden_layers)
    ids = torch.randint(0, 900, (2, 9))
    with HiddenCapture(stack, [1, 2, 3]) as normed, torch.inference_mode():
        aux_n, final_n = normed.run_stack(ids)
    with HiddenCapture(stack, [1, 2, 3], final_normed=False) as raw, torch.inference_mode():
        aux_r, final_r = raw.run_stack(ids)
        assert not torch.equal(final_r, final_n)
        torch.testing.assert_close(stack.norm(final_r), final_n)
    assert all(torch.equal(a, b) for a, b in zip(aux_r, aux_n))
    assert not stack.norm._forward_pre_hooks


def test_right_padding_does_not_change_real_tokens(tiny_target):
    arch, model = tiny_target
    stack = find_decoder_stack(model, model.config.num_hidden_layers)
    samples = [torch.randint(0, 900, (n,)) for n in (11, 4, 7)]
    ids, real = right_pad(samples)
    with HiddenCapture(stack, [1, 3, 5]) as capture:
        aux_b, final_b = capture.run_stack(ids)
        for row, s in enumerate(samples):
            aux_1, final_1 = capture.run_stack(s[None])
            n = s.numel()
            for a_b, a_1 in zip(aux_b, aux_1):
                torch.testing.assert_close(a_b[row, :n], a_1[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(final_b[row, :n], final_1[0], rtol=1e-4, atol=1e-4)
    assert real.sum() == 22


def test_hooks_are_removed_after_use(tiny_target):
    _, model = tiny_target
    stack = find_decoder_stack(model, model.config.num_hidden_layers)
    with HiddenCapture(stack, [1, 2, 3]):
        pass
    assert not stack.layers[1]._forward_pre_hooks and not stack.norm._forward_hooks


def test_find_decoder_stack_rejects_wrong_depth(tiny_target):
    from eagle3.errors import StageError

    _, model = tiny_target
    with pytest.raises(StageError, match="cannot find 99 decoder layers"):
        find_decoder_stack(model, 99)
