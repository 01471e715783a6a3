"""Crash points for the crash-consistency tests: `ROLLOUT_CRASH_AT=<point>` SIGKILLs this process when it reaches
that point of a weight commit (tests/unit/test_durable_commits.py kills a server at every phase and checks that
it restarts at the old or the new version, never a mixture). Unset (always, outside those tests): no effect."""
from __future__ import annotations

import os
import signal

COMMIT_POINTS = ("prepared", "paused", "applied", "labelled", "resumed", "files_recorded", "manifest_written")
# an adapter commit's (weights/adapter_commit.py): its directory written, loaded on every engine, its record written
ADAPTER_COMMIT_POINTS = ("adapter_files_written", "adapter_loaded", "adapter_record_written")


def crash_point(name: str) -> None:
    if os.environ.get("ROLLOUT_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
