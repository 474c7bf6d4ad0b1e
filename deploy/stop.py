"""Stop the stack that ``python -m deploy.launch`` recorded in <run_dir>/stack.json.

    python -m deploy.stop [--run-dir .run/main] [--timeout 30]

SIGTERM first (tritonserver unloads its models), SIGKILL after the timeout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.arg_types import grace_seconds
from deploy.launch import DEFAULT_RUN_DIR, stop_run_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.stop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    ap.add_argument("--timeout", type=grace_seconds, default=30.0, help="seconds between SIGTERM and SIGKILL")
    a = ap.parse_args(argv)
    if stop_run_dir(a.run_dir, a.timeout):
        print(f"[stop] stopped the stack of {a.run_dir}")
    else:
        print(f"[stop] no stack recorded in {a.run_dir / 'stack.json'}; nothing to stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
