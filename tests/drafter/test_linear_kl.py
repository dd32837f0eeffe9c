import pytest
import torch
import torch.nn.functional as F

from eagle3.drafter.linear_kl import chunk_kl, linear_kl


def _reference(x, w, teacher):
    logq = F.log_softmax(x @ w.T, -1)
    logp = F.log_softmax(teacher, -1)
    kl = (logp.exp() * (logp - logq)).sum()
    return kl, (logq.argmax(-1) == logp.argmax(-1)).sum()


@pytest.mark.parametrize("chunk_rows", [3, 64, None])  # several chunks, one, the default
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


def test_bf16_compute_keeps_float32_parameter_gradients_close_to_autograd():
    """Under bf16 autocast the per-step weight gradient is kept in bf16 until backward (half the
    memory); it stays as close to autograd's own bf16 matmul backward as bf16 allows."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 32, generator=g, requires_grad=True)
    w = torch.randn(200, 32, generator=g, requires_grad=True)
    teacher = (torch.randn(96, 200, generator=g) * 3).bfloat16()
    kl, _ = linear_kl(x, w, teacher, chunk_rows=40)
    kl.backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_kl, _ = _reference(ref_x, ref_w, teacher.float())
    ref_kl.backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    scale = ref_w.grad.abs().max()
    torch.testing.assert_close(w.grad / scale, ref_w.grad / scale, rtol=0, atol=2e-2)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=5e-2, atol=5e-2)
