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
trainer package is imported unless the user set it), and a lock records whether its
owner lives: importing `trainer.segment` (every rank, every standby) makes torch's
`FileBaton` hold an exclusive `flock` on the lock file it creates for as long as it exists,
and write a mark in it. The kernel drops
that flock when the process dies however it dies, so a marked lock nobody holds is an
orphan, and it is removed at once: by a process waiting on it (the patched `wait`) and by
the supervisor before it starts a trainer. The torch `load` that takes the lock is also the
one that loads an op already built, so a kill anywhere in a standby's or rank's start-up
could leave one (a CI run's ranks waited on a killed standby's lock until the test gave up).
A lock without the mark (another program's, or a filesystem without flock) is removed only
once it is older than the hang timeout: a build that made no progress for that long counts
as hung, exactly as a trainer that prints nothing for that long does.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time

import structlog

log = structlog.get_logger(__name__)

MARK = b"mainspring build lock, flock held by pid "
_TORCH_TRY_ACQUIRE = None  # torch's own FileBaton.try_acquire, kept by the install


def default_extensions_dir() -> str:
    env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".cache", "mainspring", "torch_extensions",
                        env_id)


def use_private_extensions_dir() -> str:
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())


def _try_acquire_owned(baton) -> bool:
    """torch's `try_acquire`, then the owner's flock on the new lock file and the mark that
    says it is held (flock first: a marked lock is always one whose flock was taken)."""
    if not _TORCH_TRY_ACQUIRE(baton):
        return False
    try:
        fcntl.flock(baton.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(baton.lock_file_path, "wb") as f:  # a second description: the flock stays
            f.write(MARK + str(os.getpid()).encode())
    except OSError:  # no flock here (some network filesystems): the age rule alone applies
        pass
    return True


def _wait_clearing_orphans(baton) -> None:
    """torch's `wait`, except that a lock whose owner died is removed, not waited on."""
    while os.path.exists(baton.lock_file_path):
        if remove_if_orphaned(baton.lock_file_path):
            return
        time.sleep(baton.wait_seconds)


def install_owned_build_locks() -> None:
    """Make torch's JIT-build lock record whether its owner lives (idempotent). Called by
    the processes that load DeepSpeed's ops (a rank, a standby: `trainer.segment`), not at
    the package's import: the supervisor imports this module and never loads torch."""
    global _TORCH_TRY_ACQUIRE
    from torch.utils.file_baton import FileBaton

    if _TORCH_TRY_ACQUIRE is None:
        _TORCH_TRY_ACQUIRE = FileBaton.try_acquire
    FileBaton.try_acquire = _try_acquire_owned
    FileBaton.wait = _wait_clearing_orphans


def remove_if_orphaned(lock: str) -> bool:
    """Remove `lock` if it carries the mark and nobody holds its flock (its owner died).

    The check holds the dead owner's flock itself and unlinks only while the path still
    names that same file, so a lock another process has just created is never removed."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        head = os.read(fd, len(MARK) + 12)
        if not head.startswith(MARK):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives
        try:
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                return False  # removed and taken again meanwhile: not this one
            os.unlink(lock)
        except FileNotFoundError:
            return False
        log.warning("orphaned_build_lock_removed", path=lock,
                    owner_pid=head[len(MARK):].decode(errors="replace"))
        return True
    finally:
        os.close(fd)


def clear_stale_build_locks(older_than_s: float, root: str | None = None,
                            now: float | None = None) -> list[str]:
    """Remove the build `lock` files under root whose owner died, and those older than
    `older_than_s` (unmarked ones); return their paths."""
    root = root or use_private_extensions_dir()
    now = time.time() if now is None else now
    removed = []
    if not os.path.isdir(root):
        return removed
    for op in os.listdir(root):
        lock = os.path.join(root, op, "lock")
        if remove_if_orphaned(lock):
            removed.append(lock)
            continue
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
