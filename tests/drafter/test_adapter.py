import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.drafter.adapter import CONFIG, WEIGHTS, load_drafter, save_drafter
from eagle3.errors import StageError
from tests.drafter.helpers import HIDDEN, tiny_drafter


@torch.no_grad()
def test_save_load_round_trip_gives_identical_outputs(tmp_path):
    m = tiny_drafter(seed=3)
    weights, config = save_drafter(m, tmp_path)
    assert weights.name == WEIGHTS and config.name == CONFIG
    assert "embed_tokens.weight" not in load_file(weights)
    loaded = load_drafter(weights, m.embed_tokens.weight).eval()
    ids, aux = torch.randint(0, 120, (2, 7)), torch.randn(2, 7, 3 * HIDDEN)
    pos = torch.arange(7).expand(2, 7)
    a = m.step(ids, m.project_aux(aux), pos)
    b = loaded.step(ids, loaded.project_aux(aux), pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # An export dir naming the layer `layers.0.` loads the same.
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(weights).items()}
    export = tmp_path / "export"
    export.mkdir()
    save_file(renamed, str(export / "model.safetensors"))
    (export / CONFIG).write_text(config.read_text())
    c = load_drafter(export, m.embed_tokens.weight).eval()
    assert torch.equal(c.step(ids, c.project_aux(aux), pos)[1], a[1])


def test_shape_mismatch_is_one_clear_error(tmp_path):
    weights, _ = save_drafter(tiny_drafter(), tmp_path)
    t = load_file(weights)
    t["lm_head.weight"] = t["lm_head.weight"][:10]
    save_file(t, str(weights))
    with pytest.raises(StageError, match="lm_head.weight has shape"):
        load_drafter(weights, torch.zeros(120, HIDDEN))
    with pytest.raises(StageError, match="target embedding"):
        save_drafter(tiny_drafter(), tmp_path)
        load_drafter(weights, torch.zeros(7, HIDDEN))
