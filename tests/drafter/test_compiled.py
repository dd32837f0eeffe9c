import torch

from eagle3.drafter.compiled import Compiled
from eagle3.drafter.loss import ttt_loss
from tests.drafter.helpers import draft_ids, teacher_batch, tiny_drafter


def failing_backend(gm, example_inputs):
    """Test double: a compiler backend that always fails, as a broken toolchain would."""
    raise RuntimeError("no compiler here")


def test_compile_failure_falls_back_to_eager_once(capsys):
    f = Compiled(lambda x: x * 2 + 1, "test function", backend=failing_backend)
    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 2 + 1)
    assert f.broken and "no compiler here" in f.broken
    assert torch.equal(f(x), x * 2 + 1)
    assert capsys.readouterr().err.count("compiled test function unavailable") == 1


def test_compiled_layer_halves_give_the_same_loss_and_gradients():
    """Dynamo tracing of the split layer (backend=eager: no C++ toolchain needed) changes nothing."""
    target, ids, aux, final, _ = teacher_batch(b=2, t=12)
    head = target.lm_head.weight.detach()[draft_ids()]
    mask = torch.ones_like(ids, dtype=torch.uint8)
    results = []
    for compiled in (False, True):
        m = tiny_drafter()
        if compiled:
            m.midlayer.compile(backend="eager")
        r = ttt_loss(m, head, ids, aux, final, mask, steps=3)
        r.loss.backward()
        results.append((r.loss.detach(), m.midlayer.self_attn.q_proj.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_eager_context_runs_uncompiled_and_restores():
    from eagle3.drafter.loss import TTTObjective

    m = tiny_drafter()
    objective = TTTObjective(m, 2, 0.8, attention="flex", compiled=True)
    compiled_halves = m.midlayer._before, m.midlayer._after
    with objective.eager():
        assert (objective.compiled, objective.attention) == (False, "sdpa")
        assert m.midlayer._before == m.midlayer.before_attention and m.midlayer._after == m.midlayer.after_attention
    assert (objective.compiled, objective.attention) == (True, "flex")
    assert (m.midlayer._before, m.midlayer._after) == compiled_halves
