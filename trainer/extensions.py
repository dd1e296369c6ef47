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
`FileBaton` hold an exclusive `flock` on its lock file for as long as the file exists
under the lock's name: the file appears already locked and marked (made unnamed, then
linked in) and is unlinked before its flock is dropped. The kernel drops that flock when
the process dies however it dies, so a marked lock nobody holds is an orphan, and it is
removed at once: by a process waiting on it (the patched `wait`) and by the supervisor
before it starts a trainer. The torch `load` that takes the lock is also the one that
loads an op already built, so a kill anywhere in a standby's or rank's start-up could
leave one (a CI run's ranks waited on a killed standby's lock until the test gave up).
A lock someone holds is never removed, whatever its age. A lock without the mark that
nobody holds (another program's, or a filesystem without flock) is removed once it is
older than the hang timeout: a build that made no progress for that long counts as hung,
exactly as a trainer that prints nothing for that long does. Every removal holds the
lock's flock and unlinks only while the name is still that same file.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import sys
import time

import structlog

log = structlog.get_logger(__name__)

MARK = b"mainspring build lock, flock held by pid "
REMOVED_EVENT = {"orphaned": "orphaned_build_lock_removed", "stale": "stale_build_lock_removed"}
_TORCH_TRY_ACQUIRE = None  # torch's own FileBaton.try_acquire, kept by the install


def default_extensions_dir() -> str:
    env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".cache", "mainspring", "torch_extensions",
                        env_id)


def use_private_extensions_dir() -> str:
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())


def _try_acquire_owned(baton) -> bool:
    """torch's `try_acquire`, except that the lock file appears already flocked and marked:
    it is made unnamed (O_TMPFILE), locked and marked, then linked in under the lock's name,
    which fails if the name exists, as O_EXCL does. A lock created first and locked after
    would be, for an instant, an unmarked file nobody holds: a sweep could take it for
    another program's stale lock and remove it under its live owner."""
    directory, name = os.path.split(os.path.abspath(baton.lock_file_path))
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return _try_acquire_then_mark(baton)
    try:
        fd = _held_marked_file(dir_fd)
    except OSError:  # no O_TMPFILE or no flock on this filesystem
        os.close(dir_fd)
        return _try_acquire_then_mark(baton)
    try:
        # dst_dir_fd makes CPython call linkat(AT_SYMLINK_FOLLOW): plain link() would link
        # the /proc symlink itself (EXDEV), not the file it names.
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
    except FileExistsError:
        os.close(fd)
        return False
    except OSError:  # no /proc, or no links here
        os.close(fd)
        return _try_acquire_then_mark(baton)
    finally:
        os.close(dir_fd)
    baton.fd = fd
    return True


def _held_marked_file(dir_fd: int) -> int:
    fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o644, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, MARK + str(os.getpid()).encode())
    except OSError:
        os.close(fd)
        raise
    return fd


def _try_acquire_then_mark(baton) -> bool:
    """torch's `try_acquire`, then the owner's flock and the mark (flock first: a marked
    lock is always one whose flock was taken)."""
    if not _TORCH_TRY_ACQUIRE(baton):
        return False
    try:
        fcntl.flock(baton.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(baton.lock_file_path, "wb") as f:  # a second description: the flock stays
            f.write(MARK + str(os.getpid()).encode())
    except OSError:  # no flock here (some network filesystems): the age rule alone applies
        pass
    return True


def _release_owned(baton) -> None:
    """torch's `release` in the other order: unlink the lock while its flock is still held,
    then close. torch closes first, and a waiter polling between the close and the remove
    found a marked lock nobody held, removed it as an orphan, and the owner's remove then
    raised FileNotFoundError after a build that had succeeded."""
    lock = baton.lock_file_path
    try:
        if _names(lock, baton.fd):  # never remove a lock that is not this baton's own
            os.unlink(lock)
        else:
            log.warning("build_lock_not_ours_at_release", path=lock)
    except FileNotFoundError:  # removed by someone else: the build itself went well
        log.warning("build_lock_gone_at_release", path=lock)
    finally:
        if baton.fd is not None:
            os.close(baton.fd)
            baton.fd = None


def _names(path: str, fd: int | None) -> bool:
    return fd is not None and os.stat(path).st_ino == os.fstat(fd).st_ino


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
    FileBaton.release = _release_owned


def remove_if_orphaned(lock: str) -> bool:
    """Remove `lock` if it carries the mark and nobody holds its flock (its owner died)."""
    return _remove_unheld(lock, older_than_s=math.inf, now=time.time()) is not None


def _remove_unheld(lock: str, older_than_s: float, now: float) -> str | None:
    """Remove `lock` unless someone holds its flock: a marked one (its owner died), an
    unmarked one once older than `older_than_s`; return why it went, None if kept.

    A held lock is never removed, whatever its age: the spec accepts any hang timeout, so
    "old" can mean any age. The removal holds the lock's flock itself and unlinks only
    while the path still names that same file, so a lock another process has just created
    in its place is never removed."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        head = os.read(fd, len(MARK) + 12)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its owner lives
        age = now - os.fstat(fd).st_mtime
        why = "orphaned" if head.startswith(MARK) else "stale" if age > older_than_s else None
        if why is None or not _unlink_if_names(lock, fd):
            return None
        log.warning(REMOVED_EVENT[why], path=lock, age_s=round(max(age, 0)),
                    owner_pid=head[len(MARK):].decode(errors="replace") or None)
        return why
    finally:
        os.close(fd)


def _unlink_if_names(lock: str, fd: int) -> bool:
    try:
        if not _names(lock, fd):
            return False  # removed and taken again meanwhile: not this one
        os.unlink(lock)
    except FileNotFoundError:
        return False
    return True


def clear_stale_build_locks(older_than_s: float, root: str | None = None,
                            now: float | None = None) -> list[str]:
    """Remove the build `lock` files under root that nobody holds: those whose owner died,
    and unmarked ones older than `older_than_s`; return their paths."""
    root = root or use_private_extensions_dir()
    now = time.time() if now is None else now
    if not os.path.isdir(root):
        return []
    locks = (os.path.join(root, op, "lock") for op in sorted(os.listdir(root)))
    return [lock for lock in locks if _remove_unheld(lock, older_than_s, now)]


def build_ops() -> list[str]:
    """Build, ahead of any trainer, the JIT ops a trainer on this machine's accelerator
    loads at start (on CPU: DeepSpeed's shared-memory comm op, ~25 s of g++ on 2 cores);
    return their names. `make install` runs it, so a fresh install's first trainer (the
    demo's, a test's, a node's first segment) loads the op instead of building it while its
    heartbeat clock runs. Under the same lock protocol as a trainer's own load."""
    install_owned_build_locks()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []  # this accelerator loads no such op (CUDA ranks talk over NCCL)
    builder.load(verbose=False)
    return [builder.NAME]

