"""Commit staged weights on every engine, or on none: prepare, swap, roll back, record.

One push at a time (the pool's push lock serializes them, and restarts and joins with them). Versions are
strictly increasing per target. The commit: every engine loads the files beside the weights it serves while it keeps
generating (prepare; if any
engine fails, all drop what they prepared and nothing changed), then pause every engine (in-flight mode),
swap the prepared weights in, label the new versions, resume: the pause lasts only the swap. If any
engine fails to swap, the engines that already swapped get the previous values back (from the original
checkpoint plus the overlays of earlier pushes), every engine resumes on the old version, and the push
fails; an engine that cannot be restored is marked unhealthy, and pool.supervisor restarts it at the
committed versions (EnginePool.restart_at_committed). What is served (versions, committed files, the
operator's pause) is the pool's; the committer changes it only by recording a commit.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from rollout_service.engine.base import EngineGone, EngineState, unless_dead
from rollout_service.errors import ServiceError
from rollout_service.faults import crash_point
from rollout_service.fingerprint import file_digests
from rollout_service.pool.pool import EnginePool
from rollout_service.scratch import recycle
from rollout_service.weights.shield import run_to_end

log = logging.getLogger(__name__)


@dataclass
class CommitResult:
    version: int
    target: str
    apply_s: float                  # swapping the prepared weights in, on every engine
    pause_s: float                  # generation paused (apply plus labelling versions and resuming)
    prepare_s: float = 0.0          # loading the new weights beside the served ones, while generating
    fingerprint: str = ""           # the target's committed values (fingerprint.py)
    materialize_s: float = 0.0      # a delta made whole against its base (weights/delta.py)


class WeightCommitter:
    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.committed = pool.committed

    def check_base(self, target: str, base_version: int, field: str = "header.base_version") -> None:
        """A delta applies to the version it was computed against, and only while that version serves."""
        serving = self.pool.versions[target]
        if base_version != serving:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{field}={base_version}, but {target} version {serving} is serving: a delta applies "
                               f"only to the version it was computed against; send a full push")

    def check_version(self, target: str, version: int) -> None:
        if not self.committed.has(target):
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this server has no {target} to update (start it with speculation configured)")
        if version <= self.pool.versions[target]:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{target} version {version} is not newer than the serving version "
                               f"{self.pool.versions[target]}; versions must strictly increase")

    async def commit(self, files: list[Path], names: list[str], version: int, target: str, mode: str,
                     keep_files: bool, prepare=None, base_version: int = 0, delta=None) -> CommitResult:
        """Apply `files` (safetensors holding `names`) as `version` of `target` on every engine.

        Runs to its end even when the caller is cancelled (shield.run_to_end), so no engine is left paused
        or half-loaded. keep_files=False hands the files to the committer: moved into its state when the
        commit lands, deleted when it fails. keep_files=True (LoadWeights) copies and never deletes them.
        prepare(engines, fill) -> one awaitable per engine, giving True if it prepared beside the served weights,
        False if it loads `files` in place once paused (default: each engine prepares from `files` + `fill`). A
        weight transfer prepares from its group, and `files` is then the record one engine writes while it
        receives. `fill`: the files (zero or one) with the committed values of the rest of the engine layers a
        partial push touches (pool/layers.py), loaded after the pushed tensors; never recorded.
        base_version and delta: a delta push (weights/delta.py). Under the push lock, once the base is checked again,
        delta(committed) -> StagedWeights makes it whole (in a thread) and its file is committed (and owned) as
        `files`."""
        owned = list(files)

        async def commit_owning_files():
            try:
                async with self.pool.push_lock:
                    if delta is None:
                        return await self._commit(files, names, version, target, mode, keep_files, prepare)
                    self.check_version(target, version)
                    self.check_base(target, base_version)
                    staged = await asyncio.to_thread(delta, self.committed)
                    owned.append(staged.path)
                    return await self._commit([staged.path], staged.names, version, target, mode, keep_files,
                                              prepare, staged.validate_s)
            finally:
                if not keep_files or delta is not None:
                    for f in owned:              # gone already if the commit moved them into its state
                        recycle(Path(f), self.committed.spare_dir)
        return await run_to_end(commit_owning_files(), "commit")

    async def _commit(self, files: list[Path], names: list[str], version: int, target: str, mode: str,
                      keep_files: bool, prepare, materialize_s: float = 0.0) -> CommitResult:
        """Under the push lock."""
        self.check_version(target, version)      # again: a concurrent push may have won the race
        # Engines starting or restarting are left out: pool.restart_at_committed (under this lock) replays
        # every committed push, this one included, before they serve.
        engines = [e for e in self.pool.engines if e.state in (EngineState.READY, EngineState.PAUSED)]
        t_prepare = time.perf_counter()
        fill = await asyncio.to_thread(self._fill, names, target)
        try:
            res = await self._commit_with(files, fill, names, version, target, mode, engines, t_prepare,
                                          keep_files, prepare)
            res.materialize_s = materialize_s
            return res
        finally:
            for f in fill:
                f.unlink(missing_ok=True)

    def _fill(self, names: list[str], target: str) -> list[Path]:
        rest = self.committed.whole_layers(names, target)
        return [self.committed.values_file(rest, target, "fill")] if rest else []

    async def _commit_with(self, files, fill, names, version, target, mode, engines, t_prepare, keep_files,
                           prepare) -> CommitResult:
        """The commit under the push lock: prepare (`files` and `fill`), pause, swap, label, resume, record."""
        loads = [*files, *fill]
        restore = names + self.committed.whole_layers(names, target)   # what a rollback restores
        # The new files' tensors are hashed for the fingerprint while the engines prepare (they work, this waits);
        # a weight transfer's record is written during its prepare: record() hashes it.
        hashing = None if prepare else asyncio.ensure_future(asyncio.to_thread(
            lambda: {Path(f): file_digests(Path(f)) for f in files}))
        prepare = prepare or (lambda es, more: [e.prepare_weights(loads, target) for e in es])
        try:
            prepared = await self._prepare(engines, prepare(engines, fill), version, target)   # engines generate
        finally:
            if hashing is not None:
                self.committed.add_digests(await hashing)
        prepare_s = time.perf_counter() - t_prepare if any(prepared) else 0.0   # 0: all load in place
        crash_point("prepared")
        held = self.pool.held is not None                               # paused by an operator already
        if not held:
            await self._pause(engines, mode, version, target)          # returns once the current step ended
        crash_point("paused")
        t_apply = time.perf_counter()                              # from here on nothing generates
        swapped = []
        try:
            for e, ready in zip(engines, prepared):
                await unless_dead(e, e.apply_weights(ready, loads, target))   # not ready: weight_reload in_place
                swapped.append(e)
        except Exception as err:  # noqa: BLE001 - any engine failure rolls the whole commit back
            failed = engines[len(swapped)]
            await asyncio.gather(*(unless_dead(e, e.discard_weights()) for e in engines[len(swapped) + 1:]),
                                 return_exceptions=True)
            await self._roll_back(swapped + [failed], restore, target)
            if not held:
                await self._resume([e for e in engines if e.state is EngineState.PAUSED])
            raise ServiceError(_code(err),
                               f"commit of {target} version {version} failed on {failed.id} "
                               f"({type(err).__name__}: {err}); every engine still serves {target} version "
                               f"{self.pool.versions[target]}") from err
        apply_s = time.perf_counter() - t_apply
        crash_point("applied")
        await self.pool.label(engines, **{target: version})
        crash_point("labelled")
        if not held:
            await self._resume(engines)
        pause_s = time.perf_counter() - t_apply
        crash_point("resumed")
        # Copying the committed file away (LoadWeights: a whole model) must not stall the event loop.
        await asyncio.to_thread(self.committed.record, files, target, version, keep_files)
        log.info("committed %s version %d (%d tensors) on %d engine(s): apply %.3f s, paused %.3f s",
                 target, version, len(names), len(engines), apply_s, pause_s)
        return CommitResult(version, target, apply_s, pause_s, prepare_s,
                            self.committed.known_content_fingerprint(target))

    async def _prepare(self, engines, preparing: list, version: int, target: str) -> list[bool]:
        """Every engine loads the new weights beside the served ones, or none keeps them. Per engine: True
        if it prepared, False if it loads in place once paused."""
        results = await asyncio.gather(*(unless_dead(e, p) for e, p in zip(engines, preparing)),
                                       return_exceptions=True)
        failed = [(e, r) for e, r in zip(engines, results) if isinstance(r, BaseException)]
        if not failed:
            return results
        await asyncio.gather(*(unless_dead(e, e.discard_weights()) for e in engines), return_exceptions=True)
        engine, err = failed[0]
        raise ServiceError(_code(err),
                           f"loading {target} version {version} failed on {engine.id} ({type(err).__name__}: "
                           f"{err}); nothing was applied, every engine still serves {target} version "
                           f"{self.pool.versions[target]}") from err

    async def _pause(self, engines, mode: str, version: int, target: str) -> None:
        """Pause every engine, or none: one that fails (or dies) to pause fails the commit, nothing applied, and the
        others resume."""
        results = await asyncio.gather(*(unless_dead(e, e.pause(mode)) for e in engines), return_exceptions=True)
        failed = [(e, r) for e, r in zip(engines, results) if isinstance(r, BaseException)]
        if not failed:
            return
        await asyncio.gather(*(unless_dead(e, e.discard_weights()) for e in engines), return_exceptions=True)
        await self._resume([e for e, r in zip(engines, results) if not isinstance(r, BaseException)])
        engine, err = failed[0]
        raise ServiceError(_code(err), f"pausing {engine.id} for {target} version {version} failed "
                                       f"({type(err).__name__}: {err}); nothing was applied, every engine still "
                                       f"serves {target} version {self.pool.versions[target]}") from err

    async def _resume(self, engines) -> None:
        """Resume `engines`; one that died meanwhile is the supervisor's (it restarts it at the committed versions),
        any other failure is raised."""
        results = await asyncio.gather(*(unless_dead(e, e.resume()) for e in engines), return_exceptions=True)
        for err in results:
            if isinstance(err, BaseException) and not isinstance(err, EngineGone):
                raise err

    async def _roll_back(self, engines, names: list[str], target: str) -> None:
        # reads and writes a model's worth
        path = await asyncio.to_thread(self.committed.values_file, names, target)
        try:
            for e in engines:
                try:
                    await unless_dead(e, e.load_weights(str(path), target))
                except Exception:  # noqa: BLE001
                    log.exception("%s: could not restore %s weights", e.id, target)
                    self.pool.mark_unhealthy(e, f"could not restore {target} weights (the supervisor restarts it)")
        finally:
            path.unlink(missing_ok=True)


def _code(err: BaseException) -> grpc.StatusCode:
    """An engine that died mid-commit: retry once it restarted (UNAVAILABLE); any other failure is INTERNAL."""
    return grpc.StatusCode.UNAVAILABLE if isinstance(err, EngineGone) else grpc.StatusCode.INTERNAL
