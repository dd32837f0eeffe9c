"""Kubernetes resource quantities as numbers and back, for sums the chart cannot do (memory + shm)."""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIX = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P)?$")


def parse(quantity: str) -> Decimal:
    """'64Gi' -> 68719476736; '500m' -> 0.5."""
    m = _QUANTITY.match(quantity)
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    return Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""]


def memory(num_bytes: Decimal) -> str:
    """Bytes as the largest binary unit that divides them (Gi, Mi, Ki), else plain bytes."""
    n = int(num_bytes.to_integral_value(rounding="ROUND_CEILING"))
    for suffix in ("Pi", "Ti", "Gi", "Mi", "Ki"):
        if n and n % _SUFFIX[suffix] == 0:
            return f"{n // _SUFFIX[suffix]}{suffix}"
    return str(n)


def cpu(cores: Decimal) -> str:
    """Whole cores as an integer string (what the static CPU manager pins), else millicores."""
    if cores == cores.to_integral_value():
        return str(int(cores))
    return f"{int((cores * 1000).to_integral_value(rounding='ROUND_CEILING'))}m"
