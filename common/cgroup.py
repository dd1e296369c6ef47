"""The kernel OOM killer's count for this process's memory cgroup (v2 `memory.events`, v1
`memory.oom_control`), read by the supervisor before a child starts and after it dies: a
rank killed by SIGKILL while the count went up was killed for memory (fault kind `oom`)."""

from __future__ import annotations

import os

ROOT = "/sys/fs/cgroup"


def memory_cgroup_files(proc_cgroup: str, root: str = ROOT) -> list[str]:
    """Pure: the files that may hold `oom_kill N` for the cgroup lines of /proc/<pid>/cgroup
    (v2 `0::/path`, v1 `N:memory:/path`), most specific first."""
    files = []
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":
            files.append(os.path.join(root, path, "memory.events"))
            files.append(os.path.join(root, "unified", path, "memory.events"))
        elif "memory" in controllers.split(","):
            files.append(os.path.join(root, "memory", path, "memory.oom_control"))
    return files


def parse_oom_kills(text: str) -> int | None:
    """Pure: N from an `oom_kill N` line (memory.events, memory.oom_control), else None."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def oom_kill_count(pid: int | str = "self") -> int | None:
    """How many processes the OOM killer has killed in `pid`'s memory cgroup; None where
    the kernel does not say (no cgroup memory controller visible)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read()
    except OSError:
        return None
    for path in memory_cgroup_files(lines):
        try:
            with open(path) as f:
                count = parse_oom_kills(f.read())
        except OSError:
            continue
        if count is not None:
            return count
    return None


def oom_kills_since(before: int | None) -> int:
    """Kills since `before` (0 when either count is unknown)."""
    now = oom_kill_count()
    return max(0, now - before) if now is not None and before is not None else 0
