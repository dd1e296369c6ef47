"""Whether a child's launcher still lives, told in a way that holds in a container.

A child arms the parent-death signal (common/procs.py) first thing; if its parent died
before that, the child was re-parented and `getppid()` names another process. "My parent
is PID 1" is not that test: in a container the worker itself may be PID 1 (its children
then always see 1, and took themselves for orphans), and a re-parented child may go to a
subreaper rather than to PID 1. So a child compares its parent with a pid its launcher
recorded (storage/tiered_writer.py, trainer/standby.py, trainer/segment.py).
"""

from __future__ import annotations


def parent_of(pid: int) -> int:
    """The parent of `pid` as /proc has it now; 0 once `pid` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0
