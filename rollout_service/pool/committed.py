"""What every serving engine holds: the committed version of each target ("policy", "drafter") and where each
tensor's committed value lives (the original checkpoint, overlaid by the files of the pushes committed since).

The pool owns it (EnginePool.committed). The weight committer records each commit here; restarts and joins
replay it; rollbacks read the previous values from it. The file methods block (they move, copy and read a
model's worth of bytes): callers run them in a thread.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from rollout_service.scratch import recycle

TARGETS = ("policy", "drafter")


class CommittedWeights:
    def __init__(self, checkpoints: dict[str, str | Path | None] | None, state_dir: Path, spare_dir: Path):
        self.versions = {t: 0 for t in TARGETS}
        # target -> the original checkpoint dir (None: the service has no such target)
        self.checkpoints = {t: Path(p) if p else None for t, p in (checkpoints or {}).items()}
        self.state_dir = state_dir
        self.spare_dir = spare_dir                       # files no longer needed become the next push's staging
        self.overlay: dict[str, dict[str, Path]] = {t: {} for t in TARGETS}   # name -> file holding its value

    def has(self, target: str) -> bool:
        return self.checkpoints.get(target) is not None

    def replay_files(self, target: str) -> list[Path]:
        """The files that bring an engine started from the checkpoint to the committed values, in commit order."""
        return sorted(set(self.overlay[target].values()))

    def record(self, files: list[Path], target: str, version: int, keep: bool) -> list[Path]:
        """Make `files` (safetensors) the committed values of the tensors they hold. keep=False moves them into
        the state folder, keep=True (files the caller still owns: LoadWeights) copies them. Files no tensor
        refers to any more are recycled. Returns the recorded paths."""
        from safetensors import safe_open

        folder = self.state_dir / target
        folder.mkdir(parents=True, exist_ok=True)
        kept = []
        for i, f in enumerate(files):
            dest = folder / f"v{version}-{i}.safetensors"
            if keep:
                shutil.copyfile(f, dest)
            else:
                shutil.move(f, dest)
            kept.append(dest)
        for dest in kept:
            with safe_open(dest, "pt") as fh:
                for name in fh.keys():
                    self.overlay[target][name] = dest
        live = set(self.overlay[target].values())
        for old in folder.glob("*.safetensors"):
            if old not in live:
                recycle(old, self.spare_dir)      # no engine reads it any more
        return kept

    def values_file(self, names: list[str], target: str) -> Path:
        """A safetensors file with the committed values of `names` (overlay first, else the checkpoint)."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        wanted = set(names)
        values = {}
        for name in wanted:
            src = self.overlay[target].get(name)
            if src is not None:
                with safe_open(src, "pt") as fh:
                    values[name] = fh.get_tensor(name)
        for f in sorted(self.checkpoints[target].glob("*.safetensors")):   # a model directory
            with safe_open(f, "pt") as fh:
                for name in fh.keys():
                    if name in wanted and name not in values:
                        values[name] = fh.get_tensor(name)
        out = self.state_dir / f"rollback-{target}.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(values, str(out))
        return out
