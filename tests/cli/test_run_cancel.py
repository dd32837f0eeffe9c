"""`eagle3ctl run … --cancel`: Ctrl-C deletes the Kubernetes Jobs instead of leaving them running."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app


@pytest.mark.parametrize("argv", [["run", "pipeline"], ["run", "stage", "vocab"]])
@pytest.mark.parametrize("cancel", [False, True])
def test_cancel_reaches_the_backend_setting(monkeypatch, argv, cancel):
    seen = {}

    def fake_run(cfg, selection, echo, **kw):
        seen["cfg"] = cfg
        raise KeyboardInterrupt  # as Ctrl-C would

    monkeypatch.setattr("eagle3.pipeline.runner.run_pipeline", fake_run)
    result = CliRunner().invoke(app, argv + ["--run-id", "x", "--backend", "kubernetes"] + (["--cancel"] if cancel else []))
    assert result.exit_code == 130
    assert seen["cfg"].kubernetes.cancel_on_interrupt is cancel
