"""Reading structured events back out of a tritonserver log (tests and benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path


def log_events(log_path: Path, event: str) -> list[dict]:
    """Every JSON event named `event` that a model logged through adapters.triton_common.log_event.

    Triton quotes the message, so each line carries the JSON as a quoted string.
    """
    found = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if f'\\"event\\":\\"{event}\\"' in line:
            quoted = line[line.index('"') : line.rindex('"') + 1]
            found.append(json.loads(json.loads(quoted)))
    return found


def warmup_report(log_path: Path) -> dict:
    """The engine's latest warmup report."""
    events = log_events(log_path, "warmup_report")
    if not events:
        raise LookupError(f"no warmup_report in {log_path}")
    return events[-1]["report"]
