"""The supervisor's settings: each from the environment variable of its name in capitals.

    POLL_SECONDS=30 MAX_RESTARTS=20 launch/tpu_pod.sh --watch ...

launch/tpu_pod.sh's header and docs/pretraining.md ("Running on a pod") say what each does.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Settings:
    """Every setting, with its default; `from_env` reads them (a value that is not a number is refused)."""

    poll_seconds: float = 60
    max_restarts: int = 10  # failures in a row without a new checkpoint before giving up
    backoff_seconds: float = 60  # before a relaunch after a failure, doubling for each in a row
    max_backoff_seconds: float = 1800
    ready_timeout: float = 3600  # a slice in any state but READY this long is recreated
    queue_timeout: float = 7 * 86400  # a queued resource waiting for capacity this long: give up
    stop_timeout: float = 600  # for workers to save on SIGTERM before SIGKILL
    lost_readings: int = 2  # readings of PREEMPTED/TERMINATED/NOT_FOUND/STOPPED before acting
    unreachable_polls: int = 5  # polls a worker may not answer over SSH before it counts as lost
    max_create_failures: int = 24  # failed creates in a row before giving up (backed off)
    max_internal_errors: int = 10  # polls in a row failing with an error of the supervisor's own
    storage_timeout: float = 120  # one storage call's limit (each tried 3 times)
    launch_timeout: float = 3600  # tpu_pod.sh's copy + install + start
    create_timeout: float = 3600  # gcloud's create
    hang_seconds: float = 0  # > 0: the fixed budget between progress signals (progress.py)
    hang_min_seconds: float = 1800
    hang_factor: float = 5
    startup_seconds: float = 3600
    lease_stale_seconds: float = 0  # 0: max(10 polls, 600 s)

    @classmethod
    def from_env(cls, env: dict) -> "Settings":
        values = {}
        for field in dataclasses.fields(cls):
            name, raw = field.name.upper(), env.get(field.name.upper(), "").strip()
            if raw:
                try:
                    values[field.name] = int(raw) if field.type == "int" else float(raw)
                except ValueError:
                    kind = "an integer" if field.type == "int" else "a number"
                    raise SystemExit(f"supervisor: {name}={raw!r} is not {kind}") from None
        out = cls(**values)
        out.lease_stale_seconds = out.lease_stale_seconds or max(10 * out.poll_seconds, 600)
        return out
