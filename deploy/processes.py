"""Whether a recorded process still runs: the launcher's stop and the client's default addresses both
read pids out of stack.json, where a pid may by now be a zombie, gone, or reused by another process."""

from __future__ import annotations

import os


def same_process(pid: int, create_time: float | None) -> bool:
    """True if `pid` runs and (when its start time was recorded) is that process, not a reused pid."""
    if pid <= 0:  # os.kill(0, 0) would signal this process group
        return False
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except OSError:  # gone, or another user's: not a process this user started
            return False
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(process.create_time() - float(create_time)) < 1.0
    except Exception:  # psutil.NoSuchProcess, AccessDenied; a malformed recorded start time
        return False
