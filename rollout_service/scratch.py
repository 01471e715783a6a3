"""The server's scratch folder and the spare file recycled through it.

One folder per server process, on /dev/shm when present (engines then map the files from memory), else the
temp dir: staged pushes, the committed overlays, and the one spare staging file. Removed at shutdown; folders
of server processes that no longer run are swept at the next start-up.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

ROOT_PREFIX = "rollout-service-"


def _scratch_base() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _own_root() -> Path:
    return _scratch_base() / f"{ROOT_PREFIX}{os.getpid()}"


def scratch_root() -> Path:
    """This process's scratch folder, created on first use."""
    root = _own_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


def remove_scratch_root() -> None:
    """At shutdown: the folder holds a copy of every pushed tensor, and on /dev/shm that is RAM that would
    stay taken after the server exits."""
    shutil.rmtree(_own_root(), ignore_errors=True)


def sweep_stale_roots() -> int:
    """At start-up: remove the folders of server processes that no longer run (killed before they could
    clean up). Returns how many bytes that freed."""
    freed = 0
    for folder in _scratch_base().glob(f"{ROOT_PREFIX}*"):
        pid = folder.name[len(ROOT_PREFIX):]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder, ignore_errors=True)
    return freed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # someone else's process
        return True
    return True


SPARE_NAME = "spare.staging"
ADAPTER_STAGING = "adapter-staging"     # adapter pushes stage apart: the full pushes' spare stays theirs
_spare_lock = threading.Lock()


def recycle(path: Path, spare_dir: Path) -> None:
    """Keep a file nobody needs any more (a superseded overlay, a failed push) as the next push's staging
    file instead of deleting it: on /dev/shm its pages stay allocated, and writing 269 MB into recycled pages
    took 0.08 s here against 0.45 s into fresh ones (each fresh page is faulted in and zeroed). One spare is
    kept, the larger; the other file is removed. Only for files no engine reads any more: the next push
    overwrites it."""
    spare = spare_dir / SPARE_NAME
    with _spare_lock:
        try:
            if spare.exists() and spare.stat().st_blocks >= path.stat().st_blocks:
                path.unlink()
            else:
                os.replace(path, spare)       # same filesystem: the committed overlays live under spare_dir
        except FileNotFoundError:
            pass
        except OSError:
            path.unlink(missing_ok=True)


def take_spare(spare_dir: Path, dest: Path) -> int:
    """Move the spare (if any) to `dest`; returns how many bytes of it hold allocated pages (0: none)."""
    with _spare_lock:
        spare = spare_dir / SPARE_NAME
        try:
            allocated = spare.stat().st_blocks * 512
            os.replace(spare, dest)
        except FileNotFoundError:
            return 0
    return allocated
