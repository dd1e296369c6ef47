"""RunSpec's `storage` section: the two checkpoint tiers, retention and the upload pipeline
(storage/tiered.py, storage/retention.py, storage/fast_tier.py). The URL rules for `durable`
and `fast` are cross-checked by RunSpec (common/urls.py). Stdlib only; re-exported by spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from spec.codec import DAY, STEPS, check_seconds, num, seconds
from spec.codec import require as _require

# Why the durations below have the minimum they have (docs/runspec.md, "storage").
RETRY = "below it an upload to a durable tier that is down retries in a hot loop"
DRAIN = ("an upload's first requests alone (connect, TLS, multipart start) can take seconds: "
         "below it a healthy store's last upload fails every segment end")


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """Where checkpoints and events live, what is kept, and how saves reach the durable tier.

    The trainer writes each checkpoint to the fast tier (local disk under `fast`) inside
    the step loop and uploads it to `durable` in the background (`async_upload`); only the
    durable commit counts as committed (DESIGN §3).
    """

    # Added fields, with the default they came with: left out of spec_hash at that default,
    # so a run claimed before they existed keeps its hash (spec/run.py).
    ADDED: ClassVar[dict[str, Any]] = {"scrub_every": 1, "scrub_newest": 2,
                                       "scrub_mb_per_s": 16.0}

    durable: str = ".mainspring/store"  # fsspec URL (file://, s3://, memory://) or a local path
    fast: str = ".mainspring/fast"  # local path of the fast tier
    keep_last: int = num(0, 0, 10**6)  # keep the newest K durable commits; 0 = keep every commit
    keep_every: int = num(0, 0, STEPS)  # with keep_last: also keep steps divisible by this
    # with keep_last: keep all commits this many steps behind newest
    rollback_horizon: int = num(0, 0, STEPS)
    async_upload: bool = True  # False = upload and commit inside the step loop (synchronous)
    max_in_flight: int = num(2, 1, 64)  # snapshots written to the fast tier but not yet durable
    # first backoff after a failed upload; doubles up to the ceiling
    upload_retry_s: float = seconds(1.0, 0.1, 3600, why=RETRY)
    upload_retry_max_s: float = seconds(30.0, 0.1, DAY, why=RETRY)  # while the durable tier is down
    # segment end: wait this long for the uploads in flight, then fail retryably
    drain_timeout_s: float = seconds(900.0, 10, 7 * DAY, why=DRAIN)
    # the background scrub (storage/scrub.py): every this many segments (0 = off) the data
    # worker reads back the checkpoints a fallback would need, at most scrub_mb_per_s
    scrub_every: int = num(1, 0, 10**6)
    scrub_newest: int = num(2, 1, 1000)  # the newest commits it verifies (and horizon, pins)
    scrub_mb_per_s: float = num(16.0, 0, 10**6)  # its read rate ceiling, 10^6 B/s; 0 = unlimited

    def __post_init__(self) -> None:
        _require(bool(self.durable), "durable", "is empty", "give a path or s3://bucket/prefix")
        for name in ("keep_last", "keep_every", "rollback_horizon"):
            _require(getattr(self, name) >= 0, name, "must be >= 0", "use 0 to disable it")
        _require(self.max_in_flight >= 1, "max_in_flight", "must be >= 1",
                 "allow at least one snapshot in flight (2 overlaps a save with an upload)")
        check_seconds(self)
        _require(self.scrub_every >= 0, "scrub_every", "must be >= 0", "use 0 to turn the scrub off")
        _require(self.scrub_newest >= 1, "scrub_newest", "must be >= 1",
                 "verify at least the newest commit, the one a resume falls back to first")
        _require(0 <= self.scrub_mb_per_s < float("inf"), "scrub_mb_per_s",
                 "must be a finite number >= 0", "give MB/s, or 0 to read unthrottled")
        _require(self.upload_retry_max_s >= self.upload_retry_s, "upload_retry_max_s",
                 "is below upload_retry_s", "make the ceiling at least the first backoff")
