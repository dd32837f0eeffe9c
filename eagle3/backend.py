"""The interface between the scheduler and where stages run (local processes, Kubernetes).

Backends know nothing about torch: they start ``eagle3 stage NAME`` somewhere, start and
stop the serve endpoint, and report how a started stage ended. The scheduler
(``eagle3.pipeline.scheduler``) decides what runs when, from the manifests in the store.

Beyond the abstract methods (each with a default, so an implementation need not change):
- ``Backend.gpu_count()`` (not abstract, default 0): GPUs a GPU stage or the server holds,
  used for the GPU-hours column. The Kubernetes backend should return gpus_per_node × nodes.
- Construction: ``eagle3.cli.backends.open_backend`` builds ``LocalBackend(cfg, state)`` or
  ``KubernetesBackend(cfg, state)``, ``state`` being the run's ``RunState``
  (``.eagle3/runs/<run_id>/state.json``); ``logs`` and ``down`` are called on a fresh instance
  from another shell, so they must work from what the state file and the cluster hold.
- ``--force STAGE`` reaches ``submit`` as ``force=True``: the stage command gets ``--force``, so
  it starts a fresh attempt beside the committed output (which stays until the new attempt
  commits) on every backend.
- ``submit`` gets the stage's ``input_key`` (the one the scheduler checked the manifest with),
  so a backend can label what it starts with it; ``attach(stage, input_key)`` (not abstract,
  default None) lets a backend hand back an attempt of that key it finds still running or
  finished (a Kubernetes Job submitted by an earlier, detached or killed CLI): the scheduler
  follows it instead of submitting a new one.
- ``detach_on_interrupt`` (default False): on Ctrl-C / SIGTERM the scheduler calls
  ``detach(handle)`` instead of ``cancel(handle)`` for running stages, leaving them running
  for a later run to attach to (the Kubernetes backend, unless told to cancel).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class StageHandle:
    """A started stage attempt (a local process, a Kubernetes Job)."""

    stage: str
    ref: str  # pid, or Job name
    started_at: float
    extra: dict = field(default_factory=dict)


@dataclass
class StageOutcome:
    stage: str
    succeeded: bool
    reason: str = ""  # one line: exit code, OOMKilled, ImagePullBackOff, Pending: Insufficient nvidia.com/gpu…
    log_tail: list[str] = field(default_factory=list)


@dataclass
class Progress:
    """Latest progress a running stage reported (parsed from its EAGLE3_PROGRESS lines)."""

    done: float = 0.0
    total: float | None = None
    unit: str = ""
    rate: float | None = None
    extra: dict = field(default_factory=dict)


class Backend(ABC):
    name: str

    @abstractmethod
    def start_serve(self) -> str:
        """Start the target's OpenAI-compatible server; return its base URL (…/v1) once ready."""

    @abstractmethod
    def stop_serve(self) -> None:
        """Stop the server and return only once its GPUs are free (pods gone / process exited)."""

    detach_on_interrupt: bool = False

    @abstractmethod
    def submit(self, stage: str, endpoint: str | None = None, input_key: str | None = None,
               force: bool = False) -> StageHandle:
        """Start ``eagle3 stage <stage>`` for this run (``--force`` when ``force``)."""

    def attach(self, stage: str, input_key: str) -> StageHandle | None:
        """An attempt of this stage with this input key that is still running (or has just
        finished) somewhere, started by an earlier CLI; None when there is none."""
        return None

    def detach(self, handle: StageHandle) -> None:
        """Stop following a running stage without stopping it (only with ``detach_on_interrupt``)."""

    @abstractmethod
    def poll(self, handle: StageHandle) -> StageOutcome | None:
        """None while running; the outcome once finished. Never blocks for long."""

    @abstractmethod
    def progress(self, handle: StageHandle) -> Progress | None:
        """Latest progress reported by the running stage, if any."""

    @abstractmethod
    def cancel(self, handle: StageHandle) -> None:
        """Stop a running stage cleanly (SIGTERM, then kill after a grace period / delete the Job)."""

    @abstractmethod
    def logs(self, stage: str, follow: bool = False, tail: int | None = None) -> list[str]:
        """Log lines of the stage's latest attempt."""

    @abstractmethod
    def down(self) -> list[str]:
        """Remove everything this run started; return what was removed."""

    def gpu_count(self) -> int:
        """GPUs a GPU stage (or the server) holds on this backend; 0 on CPU-only machines."""
        return 0
