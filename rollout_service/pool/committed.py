"""What every serving engine holds: the committed version of each target ("policy", "drafter") and where each
tensor's committed value lives (the original checkpoint, overlaid by the files of the pushes committed since).

The pool owns it (EnginePool.committed). The weight committer records each commit here; restarts and joins
replay it; rollbacks read the previous values from it. The file methods block (they move, copy and read a
model's worth of bytes): callers run them in a thread.

Durable (a configured state_dir): the record also lives in `state_dir/committed.json`, written atomically (a new
file, fsynced, renamed over the old one) after the commit's weight files are in place and fsynced, and before any
file the previous record needs is removed. A server killed at any point of a commit therefore restarts at the
old or the new version, never a mixture, and a restarted server (a new process on the same state_dir) comes
back at the last committed versions. Without a state_dir the record lives in the process's scratch folder and a
restarted server serves its model's version 0.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import uuid
from pathlib import Path

from rollout_service.config import ConfigError
from rollout_service.durable import fsync_path, write_json_atomically
from rollout_service.faults import crash_point
from rollout_service.fingerprint import Digest, combine, file_digests, tensor_ranges
from rollout_service.scratch import recycle
from rollout_service.pool.layers import completion

log = logging.getLogger(__name__)
TARGETS = ("policy", "drafter")
RECORD = "committed.json"
FORMAT = 1


class StateMismatch(ConfigError):
    """The state_dir holds commits of another model than the one this server is started on."""


def fingerprint(checkpoint: Path) -> str:
    """A checkpoint's identity for the durable record: its config.json and the names and sizes of its weight files
    (cheap: no tensor is read)."""
    h = hashlib.sha256()
    config = checkpoint / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(checkpoint.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()[:32]


class CommittedWeights:
    def __init__(self, checkpoints: dict[str, str | Path | None] | None, state_dir: Path, spare_dir: Path,
                 durable: bool = False):
        self.versions = {t: 0 for t in TARGETS}
        # target -> the original checkpoint dir (None: the service has no such target)
        self.checkpoints = {t: Path(p) if p else None for t, p in (checkpoints or {}).items()}
        self.state_dir = state_dir
        self.spare_dir = spare_dir                       # files no longer needed become the next push's staging
        self.overlay: dict[str, dict[str, Path]] = {t: {} for t in TARGETS}   # name -> file holding its value
        self.durable = durable
        self.restored = {t: 0 for t in TARGETS}          # versions read back from state_dir at start-up
        self.aside: dict[str, dict] = {}                 # target -> its record for another checkpoint, kept as is
        self._checkpoint_names: dict[str, list[str]] = {}   # target -> its checkpoint's tensor names (read once)
        # content fingerprints (fingerprint.py): per-file tensor digests, hashed once per file, and per target the
        # fingerprint of the committed values; computed in threads (record, fingerprints), hence the lock
        self._digests: dict[Path, dict[str, Digest]] = {}
        self._fingerprints: dict[str, tuple[int, str]] = {}     # target -> (version, fingerprint)
        self._digest_lock = threading.Lock()
        self._pending: dict[Path, dict[str, Digest]] = {}       # digests of files about to be recorded
        if durable:
            self._restore()

    def has(self, target: str) -> bool:
        return self.checkpoints.get(target) is not None

    def record(self, files: list[Path], target: str, version: int, keep: bool) -> list[Path]:
        """Make `files` (safetensors) the committed values of the tensors they hold, as `version` of `target`.
        keep=False moves them into the state folder, keep=True (files the caller still owns: LoadWeights) copies
        them. Files no tensor refers to any more are recycled. Returns the recorded paths."""
        from safetensors import safe_open

        folder = self.state_dir / target
        folder.mkdir(parents=True, exist_ok=True)
        kept = []
        with self._digest_lock:
            pending = dict(self._pending)
        for i, f in enumerate(files):
            dest = folder / f"v{version}-{i}.safetensors"
            if Path(f) in pending:
                with self._digest_lock:
                    self._digests[dest] = pending[Path(f)]
            if keep:
                shutil.copyfile(f, dest)
            else:
                shutil.move(f, dest)
            if self.durable:
                fsync_path(dest)
            kept.append(dest)
        crash_point("files_recorded")
        for dest in kept:
            with safe_open(dest, "pt") as fh:
                for name in fh.keys():
                    self.overlay[target][name] = dest
        self.versions[target] = version
        if self.durable:
            self._write_record()
        crash_point("manifest_written")
        live = set(self.overlay[target].values())
        for old in folder.glob("*.safetensors"):
            if old not in live:
                recycle(old, self.spare_dir)      # no engine reads it any more
        with self._digest_lock:
            for old in [f for f in self._digests if f.parent == folder and f not in live]:
                del self._digests[old]
            self._pending = {}
        self.content_fingerprint(target)          # the recorded files are hashed now, while they are in the cache
        return kept

    def content_fingerprint(self, target: str) -> str:
        """The fingerprint (fingerprint.py) of the target's committed values. Blocking the first time a file is
        seen (it hashes the checkpoint's and each recorded file's tensors once): call it in a thread."""
        with self._digest_lock:
            version = self.versions[target]
            done = self._fingerprints.get(target)
            if not self.has(target):
                return ""
            if done is not None and done[0] == version:
                return done[1]
            overlay = dict(self.overlay[target])
        digests = {}
        for f in sorted(self.checkpoints[target].glob("*.safetensors")):
            digests.update(self._file_digests(f))
        for name, f in overlay.items():
            digests[name] = self._file_digests(f)[name]
        out = combine(digests)
        with self._digest_lock:
            if self.versions[target] == version and self.overlay[target] == overlay:
                self._fingerprints[target] = (version, out)
        return out

    def known_content_fingerprint(self, target: str, version: int | None = None) -> str:
        """The fingerprint of `version` (default: the committed one) if it was computed already, else "" (never
        blocks: GetStatus)."""
        done = self._fingerprints.get(target)
        want = self.versions[target] if version is None else version
        return done[1] if done is not None and done[0] == want else ""

    def _file_digests(self, f: Path) -> dict[str, Digest]:
        with self._digest_lock:
            found = self._digests.get(f)
        if found is None:
            found = file_digests(f)
            with self._digest_lock:
                self._digests[f] = found
        return found

    def checkpoint_names(self, target: str) -> list[str]:
        """Every tensor name of the target's checkpoint (its safetensors headers; read once)."""
        cache = self._checkpoint_names
        if target not in cache:
            from safetensors import safe_open

            names = []
            for f in sorted(self.checkpoints[target].glob("*.safetensors")):
                with safe_open(f, "pt") as fh:
                    names += list(fh.keys())
            cache[target] = names
        return cache[target]

    def whole_layers(self, names, target: str) -> list[str]:
        """The other checkpoint tensors of the engine layers `names` load into (pool/layers.py): a partial load
        must carry their committed values too."""
        return completion(names, self.checkpoint_names(target))

    def replay_file(self, target: str) -> Path | None:
        """One file that brings an engine started from the checkpoint to the committed values (every overlaid
        tensor, with the rest of the layers they load into), or None when nothing was committed."""
        names = list(self.overlay[target])
        if not names:
            return None
        return self.values_file(names + self.whole_layers(names, target), target, "replay")

    def values_file(self, names: list[str], target: str, purpose: str = "rollback") -> Path:
        """A safetensors file with the committed values of `names` (overlay first, else the checkpoint)."""
        from safetensors.torch import save_file

        out = self.spare_dir / f"{purpose}-{target}-{uuid.uuid4().hex[:8]}.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(self.values(names, target), str(out))
        return out

    def sources(self, names, target: str) -> dict[str, tuple[Path, str, int, int]]:
        """name -> (file, dtype, start, end): where the committed value of each of `names` lies (overlay first, else
        the checkpoint). Reads headers only."""
        wanted = set(names)
        out, headers = {}, {}
        for name in wanted:
            src = self.overlay[target].get(name)
            if src is not None:
                if src not in headers:                 # a file's header read once
                    headers[src] = tensor_ranges(src)
                out[name] = (src, *headers[src][name])
        for f in sorted(self.checkpoints[target].glob("*.safetensors")):
            for name, where in tensor_ranges(f).items():
                if name in wanted and name not in out:
                    out[name] = (f, *where)
        return out

    def add_digests(self, digests: dict[Path, dict[str, Digest]]) -> None:
        """Per-file tensor digests computed elsewhere (the committer hashes a push's files while engines prepare),
        for files about to be recorded: record() finds them instead of hashing again."""
        with self._digest_lock:
            self._pending.update(digests)

    def values(self, names, target: str) -> dict:
        """name -> a tensor of its committed value (overlay first, else the checkpoint), for each of `names`."""
        from safetensors import safe_open

        wanted = set(names)
        values = {}
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            src = self.overlay[target].get(name)
            if src is not None:
                by_file.setdefault(src, []).append(name)
        for src, inside in by_file.items():
            with safe_open(src, "pt") as fh:
                for name in inside:
                    values[name] = fh.get_tensor(name)
        for f in sorted(self.checkpoints[target].glob("*.safetensors")):   # a model directory
            with safe_open(f, "pt") as fh:
                for name in fh.keys():
                    if name in wanted and name not in values:
                        values[name] = fh.get_tensor(name)
        return values

    # ---- the durable record ---------------------------------------------------------------------------
    def _write_record(self) -> None:
        record = {
            "format": FORMAT,
            "versions": dict(self.versions),
            "checkpoints": {t: {"path": str(p), "fingerprint": fingerprint(p)}
                            for t, p in self.checkpoints.items() if p is not None},
            "overlay": {t: {name: str(f.relative_to(self.state_dir)) for name, f in sorted(files.items())}
                        for t, files in self.overlay.items()},
        }
        for target, old in self.aside.items():     # until this server commits that target itself
            if not self.overlay[target]:
                record["versions"][target] = old["version"]
                record["checkpoints"][target] = old["checkpoint"]
                record["overlay"][target] = old["overlay"]
        write_json_atomically(self.state_dir / RECORD, record)

    def _restore(self) -> None:
        """Read state_dir's record (if any) back: the versions and the overlay files; remove files no record
        refers to (a commit killed before its record was written). A record for another policy model is refused;
        one for another drafter is set aside (the drafter starts at version 0)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / (RECORD + ".tmp")).unlink(missing_ok=True)
        path = self.state_dir / RECORD
        record = json.loads(path.read_text()) if path.is_file() else None
        if record is not None and record.get("format") != FORMAT:
            raise StateMismatch(f"{path}: record format {record.get('format')!r}, this server reads {FORMAT}")
        for target in TARGETS:
            if record is None or not record["overlay"].get(target):
                continue
            ckpt = self.checkpoints.get(target)
            saved = record["checkpoints"].get(target, {})
            version = record["versions"][target]
            if ckpt is None or saved.get("fingerprint") != fingerprint(ckpt):
                why = (f"state_dir {self.state_dir} holds {target} version {version} committed over "
                       f"{saved.get('path')}, but this server's {target} is {ckpt or 'none'}")
                if target == "policy":
                    raise StateMismatch(why + ": start it on that model, or with another (or an emptied) "
                                              "state_dir to start from version 0")
                log.warning("%s: the drafter starts at version 0 (that record is kept until this server commits a "
                            "drafter)", why)
                self.aside[target] = {"version": version, "checkpoint": saved, "overlay": record["overlay"][target]}
                continue
            files = {name: self.state_dir / rel for name, rel in record["overlay"][target].items()}
            missing = sorted({str(f) for f in files.values() if not f.is_file()})
            if missing:
                raise StateMismatch(f"state_dir {self.state_dir}: {target} version {version}'s weight files are "
                                    f"missing ({', '.join(missing[:3])}); restore them or start with an emptied "
                                    "state_dir")
            self.overlay[target] = files
            self.versions[target] = self.restored[target] = version
        for target in TARGETS:                     # files of commits that never reached the record
            if target in self.aside:
                continue
            live = set(self.overlay[target].values())
            for f in (self.state_dir / target).glob("*.safetensors"):
                if f not in live:
                    f.unlink()
