"""Shared caches (the default model, drafters) are replaced in one step under a lock (models.save_atomically,
replace_dir, cache_lock): two processes preparing the same directory while a third reads it never let the reader
see a partial directory or none, and a preparer that waited for the lock finds the other's result."""
import json
import multiprocessing
import os
import time
from pathlib import Path

from rollout_service import models

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class Saved:
    """save_pretrained as transformers' writes it: file after file, so a directory in the making is partial."""

    def __init__(self, stamp: str, names):
        self.stamp, self.names = stamp, names

    def save_pretrained(self, path, **_):
        for name in self.names:
            (Path(path) / name).write_text(json.dumps({"stamp": self.stamp, "pad": "x" * 20000}))
            time.sleep(0.001)


def prepare(out: str, who: int, rounds: int) -> None:
    for i in range(rounds):
        models.save_atomically(Saved(f"{who}-{i}", FILES[:2]), Saved(f"{who}-{i}", FILES[2:]), Path(out))


def read(out: str, seconds: float, bad) -> None:
    end = time.monotonic() + seconds
    reads = 0
    while time.monotonic() < end:
        for name in FILES:
            try:
                json.loads((Path(out) / name).read_text())
            except (OSError, ValueError) as e:
                bad.put(f"{name}: {type(e).__name__}: {e}")
                return
        reads += 1
    bad.put(f"ok {reads}")


def test_two_preparers_and_a_reader_never_see_a_partial_directory(tmp_path):
    out = tmp_path / "models" / "m"
    prepare(str(out), 0, 1)                         # a first complete version
    ctx = multiprocessing.get_context("fork")
    bad = ctx.Queue()
    procs = [ctx.Process(target=prepare, args=(str(out), w, 40)) for w in (1, 2)]
    reader = ctx.Process(target=read, args=(str(out), 4.0, bad))
    reader.start()
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    reader.join(60)
    result = bad.get(timeout=5)
    assert result.startswith("ok"), f"a reader saw a partial cache directory: {result}"
    assert all(p.exitcode == 0 for p in procs)
    assert sorted(os.listdir(out)) == sorted(FILES)
    assert [p.name for p in out.parent.iterdir() if not p.name.startswith(".m.lock")] == ["m"]   # no leftovers


def test_a_waiting_preparer_uses_what_the_other_prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_SERVICE_HOME", str(tmp_path))
    out = models.default_model_dir()
    calls = []

    def convert(path):
        calls.append(path)
        prepare(str(path), 9, 1)
        (path / "model.safetensors").write_text("{}")
        return path
    monkeypatch.setattr(models, "_convert_default_model", convert)
    with models.cache_lock(out):                  # another preparer holds it, and finishes meanwhile
        with models.cache_lock(out):              # reentrant within a process
            prepare(str(out), 8, 1)
    assert models.prepare_default_model() == out and calls == []     # found, not prepared again
    assert models.prepare_default_model(force=True) == out and calls == [out]
