"""Where DeepSpeed's JIT-built C++ ops live, and recovery from a builder that died.

On CPU, DeepSpeed JIT-builds its shared-memory comm op the first time a trainer starts
(torch.utils.cpp_extension, ninja). Two hazards with torch's default build directory
(`~/.cache/torch_extensions/<python>_<device>`):

- it is shared by every Python environment of the user; the build flags embed each
  environment's include paths, so two virtualenvs rebuild the same op over each other;
- the build holds a `lock` file (created with O_EXCL, no owner recorded) and every other
  process waits for it to disappear; a builder that is killed mid-build (a lost node, a
  preemption, a test's SIGKILL) leaves it behind and every later trainer waits forever.

So each Python environment gets its own directory (TORCH_EXTENSIONS_DIR, set when the
trainer package is imported unless the user set it), and the supervisor removes a lock
older than the hang timeout before it starts a trainer: a build that made no progress for
that long counts as hung, exactly as a trainer that prints nothing for that long does.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import structlog

log = structlog.get_logger(__name__)


def default_extensions_dir() -> str:
    env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".cache", "mainspring", "torch_extensions",
                        env_id)


def use_private_extensions_dir() -> str:
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())


def clear_stale_build_locks(older_than_s: float, root: str | None = None,
                            now: float | None = None) -> list[str]:
    """Remove build `lock` files under root older than `older_than_s`; return their paths."""
    root = root or use_private_extensions_dir()
    now = time.time() if now is None else now
    removed = []
    if not os.path.isdir(root):
        return removed
    for op in os.listdir(root):
        lock = os.path.join(root, op, "lock")
        try:
            age = now - os.stat(lock).st_mtime
        except FileNotFoundError:
            continue
        if age > older_than_s:
            try:
                os.unlink(lock)
            except FileNotFoundError:  # another supervisor got there first
                continue
            log.warning("stale_build_lock_removed", path=lock, age_s=round(age))
            removed.append(lock)
    return removed
