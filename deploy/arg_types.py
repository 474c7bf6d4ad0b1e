"""argparse types the command lines share: a NaN or infinite time made waits never end or end at once."""

from __future__ import annotations

import argparse
import math


def _finite(text: str, allow_zero: bool) -> float:
    value = float(text)
    if not (math.isfinite(value) and (value > 0 or (allow_zero and value == 0))):
        bound = ">= 0" if allow_zero else "> 0"
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds {bound}, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (timeouts, waits)."""
    return _finite(text, allow_zero=False)


def grace_seconds(text: str) -> float:
    """A finite number of seconds >= 0 (a grace period that may be skipped)."""
    return _finite(text, allow_zero=True)
