"""This process's threads as the kernel counts them (against a pids limit).

What each OS gives:

    Linux   /proc/self/task, one entry per task: a thread Python has joined
            still counts for a moment, until the kernel releases it.
    macOS   no per-process task limit of that kind to wait for (RLIMIT_NPROC
            counts processes); None: the caller does not wait.
"""

from __future__ import annotations

import os


def task_count() -> int | None:
    """The kernel's count of this process's threads, None where not told."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None
