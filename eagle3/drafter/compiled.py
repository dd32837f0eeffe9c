"""``torch.compile`` with a way back: if compiling fails on this machine, run eagerly.

Compile failures vary by torch version, device and driver; training must not die of
one. The first failure is reported once on stderr and every later call runs the plain
function (same math, more kernels).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


class Compiled:
    def __init__(self, fn: Callable[..., Any], what: str, **compile_kwargs: Any) -> None:
        self.fn, self.what, self.kwargs = fn, what, compile_kwargs
        self._compiled: Callable[..., Any] | None = None
        self.broken: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.broken is None:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(self.fn, **self.kwargs)
                return self._compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 (compile/backend failures vary by version and device)
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                self.broken = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"  # one line
                print(f"compiled {self.what} unavailable ({self.broken}); it runs eagerly", file=sys.stderr)
        return self.fn(*args, **kwargs)
