import pytest
import torch
import torch.nn.functional as F

from eagle3.drafter.linear_kl import chunk_kl, linear_kl


def _reference(x, w, teacher):
    logq = F.log_softmax(x @ w.T, -1)
    logp = F.log_softmax(teacher, -1)
    kl = (logp.exp() * (logp - logq)).sum()
    return kl, (logq.argmax(-1) == logp.argmax(-1)).sum()


@pytest.mark.parametrize("chunk_rows", [3, 64])
def test_fused_kl_and_gradients_equal_autograd(chunk_rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(10, 40, generator=g, dtype=torch.float64) * 3
    kl, hits = linear_kl(x, w, teacher, chunk_rows)
    (2.5 * kl).backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_kl, ref_hits = _reference(ref_x, ref_w, teacher)
    (2.5 * ref_kl).backward()
    torch.testing.assert_close(kl.double(), ref_kl)  # the fused KL accumulates in float32
    assert int(hits) == int(ref_hits)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)  # softmaxes run in float32
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-5, atol=1e-5)


def test_logit_gradient_is_softmax_minus_teacher():
    x, w, teacher = torch.randn(4, 8), torch.randn(12, 8), torch.randn(4, 12)
    _, _, grad = chunk_kl(x, w, teacher)
    torch.testing.assert_close(grad, F.softmax(x @ w.T, -1) - F.softmax(teacher, -1))


def test_mismatched_shapes_are_one_clear_error():
    with pytest.raises(ValueError, match="do not match"):
        linear_kl(torch.randn(4, 8), torch.randn(12, 8), torch.randn(5, 12))
