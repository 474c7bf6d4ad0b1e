"""Reading structured events back out of a tritonserver log (tests and benchmarks)."""

from __future__ import annotations

import json
import re
from pathlib import Path


_SOURCE = re.compile(r"^\[[^\]]*\] ")  # "[loader.py:144] ": the engine's serialized log names its caller


def log_events(log_path: Path, event: str) -> list[dict]:
    """Every JSON event named `event` that a model logged (adapters.triton_common.log_event, or the
    engine's own `json.dumps` lines through its serialized log, which puts "[file:line] " first).

    Triton quotes the message, so each line carries the JSON as a quoted string.
    """
    found = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if event not in line or '"' not in line:
            continue
        try:
            message = json.loads(line[line.index('"') : line.rindex('"') + 1])
            obj = json.loads(_SOURCE.sub("", message, count=1))
        except (ValueError, TypeError):
            continue
        if isinstance(obj, dict) and obj.get("event") == event:
            found.append(obj)
    return found


def warmup_report(log_path: Path) -> dict:
    """The engine's latest warmup report."""
    events = log_events(log_path, "warmup_report")
    if not events:
        raise LookupError(f"no warmup_report in {log_path}")
    return events[-1]["report"]
