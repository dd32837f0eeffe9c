"""Shared CLI pieces: option aliases, config loading, and one-line errors."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer

from eagle3.config import PipelineConfig, derived_run_id, load_config
from eagle3.cli.launch import record_exit_code
from eagle3.errors import ConfigError, Eagle3Error

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Pipeline config (YAML).")]
RunIdOpt = Annotated[Optional[str], typer.Option("--run-id", help="Run id (overrides the config).")]
StoreOpt = Annotated[Optional[str], typer.Option("--store", help="Store URI: file://PATH or s3://BUCKET/PREFIX.")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", help="local or kubernetes (overrides the config).")]

F = TypeVar("F", bound=Callable[..., Any])

HELP = {"help_option_names": ["-h", "--help"]}  # every command group takes -h as well as --help


def version_text() -> str:
    """``eagle3ctl <version>`` as installed (a checkout installed with ``pip install -e .`` included)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"eagle3ctl {version('eagle3ctl')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "eagle3ctl (not installed: run `pip install -e .` in the checkout)"


def config_from(config: Path | None, run_id: str | None = None, store: str | None = None, backend: str | None = None,
                extra: dict[str, Any] | None = None) -> PipelineConfig:
    """The config of the command: ``-c`` (or, for a run already in the store, ``--run-id``) is required,
    so leaving it out never silently runs or reports a default run."""
    if config is None and run_id is None and not os.environ.get("EAGLE3_RUN_ID"):
        raise ConfigError("no config: pass -c CONFIG (`eagle3ctl init` writes one), or --run-id ID for a run in the store")
    return load_config(config, {"run_id": run_id, "store.uri": store, "backend": backend, **(extra or {})})


def announce_run_id(config: Path | None, cfg: PipelineConfig) -> str | None:
    """A line naming a run id derived from the config file (None when the run was named)."""
    if config is not None and cfg.run_id == derived_run_id(config):
        return f"run {cfg.run_id} (named after {config}; set run_id in it to choose a name)"
    return None


def fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def os_error_line(e: OSError) -> str:
    """``PATH: reason`` as the shell's tools say it; the reason alone when the OS named no file."""
    reason = e.strerror or str(e) or type(e).__name__
    return f"{e.filename}: {reason}" if e.filename else reason


def one_line_errors(func: F) -> F:
    """Known errors become 'error: …' and a non-zero exit; tracebacks only with EAGLE3_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Eagle3Error as e:
            record_exit_code(e.exit_code)  # under eagle3-torchrun: the pod exits with it, not torchrun's 1
            if os.environ.get("EAGLE3_DEBUG"):
                raise
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        except OSError as e:  # the machine refusing (disk full, no permission, read-only): not a bug
            record_exit_code(1)
            if os.environ.get("EAGLE3_DEBUG"):
                raise
            typer.echo(f"error: {os_error_line(e)}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def run_app(app: typer.Typer) -> None:
    try:
        app()
    except SystemExit:
        raise
    except Exception as e:  # an unknown failure: still one line unless debugging
        if os.environ.get("EAGLE3_DEBUG"):
            raise
        print(f"error: unexpected {type(e).__name__}: {e} (set EAGLE3_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
