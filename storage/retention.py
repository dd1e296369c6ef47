"""Which committed checkpoints to delete: a pure function of the committed steps (DESIGN §7).

Kept: the last `keep_last`, every `keep_every`-th step, anything promoted, anything inside
the rollback horizon (the spike detector may roll back up to `rollback_horizon` steps
behind the newest commit, DESIGN §3) *and the newest commit at or before its edge* — the
checkpoint a rollback to the edge restores (with `keep_last=1` a spike just
after a commit found nothing before its onset) — and always the newest verified
checkpoint, even if a caller passes a policy that would keep nothing. The trainer sets
the horizon to at least the detector's reach (`spike_reach`). The newest commit at or
before each pinned step (an admitted operator rollback's target, storage/rollback.py) is
kept too. And where that commit (at the horizon's edge, or at a pin) has not been read back
by the checkpoint scrub (storage/scrub.py) yet, the newest one the scrub did verify at or
before the same step stays as well: should the unread one turn out corrupt, the rollback,
and the scrub's uncommit, still find a verified commit below it.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from common.errors import BadConfig

log = structlog.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    keep_last: int = 0  # the newest K commits; 0 keeps every commit (retention off)
    keep_every: int = 0  # also keep steps divisible by M (long-horizon history); 0 = none
    rollback_horizon: int = 0  # keep every commit within this many steps of the newest

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "rollback_horizon"):
            if getattr(self, name) < 0:
                raise BadConfig(f"storage.{name}", f"must be >= 0, got {getattr(self, name)}",
                                "use 0 to disable this rule")

    @property
    def enabled(self) -> bool:
        return self.keep_last > 0


def steps_to_keep(committed: list[int], policy: RetentionPolicy, *, promoted: frozenset[int]
                  = frozenset(), newest_verified: int | None = None,
                  pinned: frozenset[int] = frozenset(),
                  scrubbed: frozenset[int] = frozenset()) -> set[int]:
    if not committed:
        return set()
    if not policy.enabled:
        return set(committed)
    newest = max(committed)
    keep = set(sorted(committed)[-policy.keep_last:])
    keep |= {s for s in committed if policy.keep_every and s % policy.keep_every == 0}
    keep |= {s for s in committed if s in promoted}
    keep |= {s for s in committed if newest - s <= policy.rollback_horizon}
    keep.add(max((s for s in committed if s <= newest - policy.rollback_horizon), default=newest))
    keep.add(newest if newest_verified is None else newest_verified)
    for target in pinned:  # an admitted operator rollback restores the newest at or before it
        keep.add(max((s for s in committed if s <= target), default=newest))
    for target in [newest - policy.rollback_horizon, *pinned]:
        below = sorted(s for s in committed if s <= target)
        if below and below[-1] not in scrubbed:  # not read back yet: a verified one below
            keep |= set([s for s in below if s in scrubbed][-1:])
    return keep


def spike_reach(window: int) -> int:
    """How far behind the newest commit a spike rollback may restore: the onset lies within
    the detector's window of the current step, and the rollback goes 2 steps before it
    (trainer/guard.py)."""
    return window + 2


def steps_to_delete(committed: list[int], policy: RetentionPolicy, *, promoted: frozenset[int]
                    = frozenset(), newest_verified: int | None = None,
                    pinned: frozenset[int] = frozenset(),
                    scrubbed: frozenset[int] = frozenset()) -> list[int]:
    """Committed steps the policy lets go, oldest first; never the newest verified one."""
    keep = steps_to_keep(committed, policy, promoted=promoted, newest_verified=newest_verified,
                         pinned=pinned, scrubbed=scrubbed)
    return sorted(s for s in committed if s not in keep)


def apply_retention(store, policy: RetentionPolicy, *, newest_verified: int | None = None,
                    ) -> list[int]:
    """Delete what the policy lets go from `store` (a CheckpointStore); returns the steps."""
    if not policy.enabled:
        return []
    from storage.rollback import live_committed, pinned_steps  # (rollback imports the store)
    from storage.scrub import scrubbed_steps

    # A commit of a lineage a rollback left (one a rollback cut short did not uncommit, or
    # a racing writer's) is neither the newest nor a fallback: counted, it would push the
    # live checkpoints a rollback needs out of the policy's window.
    doomed = steps_to_delete(live_committed(store), policy,
                             promoted=frozenset(store.list_promoted()),
                             newest_verified=newest_verified, pinned=pinned_steps(store),
                             scrubbed=scrubbed_steps(store))
    for step in doomed:
        store.delete(step)
    if doomed:
        log.info("retention_deleted", steps=doomed, uri=store.url)
    return doomed
