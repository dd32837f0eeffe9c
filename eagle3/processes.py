"""Processes per node of the stages that run under torchrun (extract, train): a count or "auto".

Validated where the config is read, so a bad value is one config error line for every
command; :func:`processes_per_node` turns "auto" into a number for the machine at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator


def _parse(value: Any) -> Any:
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive number or 'auto', not {value!r}")
    return value


ProcsPerNode = Annotated[Union[int, Literal["auto"]], BeforeValidator(_parse)]


def processes_per_node(value: int | str, device: str, gpu_count: Callable[[], int]) -> int:
    """``value`` as a number: "auto" is this machine's GPUs (at least 1), or 1 on ``device: cpu``."""
    if value == "auto":
        return 1 if device == "cpu" else max(1, gpu_count())
    return int(value)
