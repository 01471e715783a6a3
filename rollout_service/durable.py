"""Writes that survive a crash or a power cut at any point: a file is fsynced before anything names it, and a record
replaces its previous version atomically (a new file, fsynced, renamed over the old one, the rename fsynced).
Blocking: callers run them in a thread. Used by the committed version's record (pool/committed.py) and the adapters'
(pool/adapters.py, weights/adapters.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: the names in it, e.g. a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomically(path: Path, record: dict) -> None:
    """`path` holds either its previous content or `record`, whole, whatever happens during the call."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)                    # the rename itself
