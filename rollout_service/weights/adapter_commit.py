"""Commit a LoRA adapter version on every engine, or on none.

An adapter version is a PEFT directory (adapters.write_dir) that every engine loads as a vLLM LoRA of its own
(AsyncLLM.add_lora: between engine steps, ~40 ms here; nothing pauses, samples in flight on older versions keep
their adapter). If any engine fails to load it, the engines that did unload it, the directory is deleted and the
adapter's previous versions serve as before. Once every engine holds it, the registry records it as the name's latest
and the versions beyond engine.lora.versions_kept are unloaded (each once nothing runs on it). Under the pool's push
lock: no engine restarts or joins mid-commit (those load every recorded version, pool._catch_up).

With a state_dir the commit is durable: the directory is fsynced before the engines load it, and the record
(pool/adapters.py, state_dir/adapters.json) is written once every engine holds it and before the registry serves it;
a record that cannot be written fails the commit like an engine that cannot load it. An unload is recorded before it
takes effect.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from rollout_service.engine.base import EngineGone, EngineState, unless_dead
from rollout_service.errors import ServiceError
from rollout_service.faults import crash_point
from rollout_service.pool.adapters import Adapter, AdapterVersion
from rollout_service.pool.pool import EnginePool
from rollout_service.weights.adapters import AdapterSpec, write_dir
from rollout_service.weights.shield import run_to_end

log = logging.getLogger(__name__)


@dataclass
class AdapterCommit:
    version: int
    apply_s: float                # every engine loading the adapter (generation goes on)


class AdapterCommitter:
    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.registry = pool.adapters

    async def commit(self, name: str, version: int, spec: AdapterSpec, weights: Path, num_bytes: int,
                     tenant: str, keep_file: bool) -> AdapterCommit:
        """Make `weights` (a safetensors file of `spec`'s tensors) version `version` of adapter `name` on every
        engine. keep_file: copy it (LoadWeights: the caller's file), else move it (a push's staging file, recycled
        by the caller if the commit fails). Runs to its end even when the caller is cancelled."""
        return await run_to_end(self._commit(name, version, spec, weights, num_bytes, tenant, keep_file),
                                "adapter commit")

    async def _commit(self, name, version, spec, weights, num_bytes, tenant, keep_file) -> AdapterCommit:
        async with self.pool.push_lock:
            self.registry.check_push(name, version, "")          # again: a concurrent push may have won
            folder = self.registry.folder(name, version)
            await asyncio.to_thread(shutil.rmtree, folder, True)  # a failed earlier attempt's leftovers
            await asyncio.to_thread(write_dir, folder, spec.config, weights, keep_file, self.registry.durable)
            crash_point("adapter_files_written")
            av = AdapterVersion(name, version, self.registry.new_id(), folder, spec.rank, num_bytes,
                                spec.target_modules)
            engines = [e for e in self.pool.engines if e.state in (EngineState.READY, EngineState.PAUSED)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(unless_dead(e, e.add_adapter(av.vllm_name, av.lora_id, str(folder)))
                                             for e in engines), return_exceptions=True)
            failed = [(e.id, r) for e, r in zip(engines, results) if isinstance(r, BaseException)]
            loaded = [e for e, r in zip(engines, results) if not isinstance(r, BaseException)]
            if not failed and self.registry.durable:
                crash_point("adapter_loaded")
                try:
                    await asyncio.to_thread(self.registry.save, self.registry.snapshot(add=av, tenant=tenant))
                except OSError as e:
                    failed = [(f"the state_dir ({self.registry.record_path})", e)]
                crash_point("adapter_record_written")
            if failed:
                await asyncio.gather(*(unless_dead(e, e.remove_adapter(av.lora_id)) for e in loaded),
                                     return_exceptions=True)
                await asyncio.to_thread(shutil.rmtree, folder, True)
                where, err = failed[0]
                previous = self.registry.adapters.get(name)
                still = (f"adapter {name!r} version {previous.latest} still serves" if previous and previous.latest
                         else f"adapter {name!r} is not served")
                code = (grpc.StatusCode.INVALID_ARGUMENT if _refused(err) else grpc.StatusCode.UNAVAILABLE
                        if isinstance(err, EngineGone) else grpc.StatusCode.INTERNAL)
                raise ServiceError(code, f"loading adapter {name!r} version {version} failed on {where} "
                                         f"({type(err).__name__}: {err}); nothing changed: {still}"
                                         + ("; retry once the engine restarted" if isinstance(err, EngineGone)
                                            else "")) from err
            apply_s = time.perf_counter() - t0
            drop = self.registry.record(av, tenant)
        if drop:
            await self.pool.unload_adapters(drop)
        log.info("committed adapter %s version %d (rank %d, %d bytes) on %d engine(s) in %.3f s", name, version,
                 spec.rank, num_bytes, len(engines), apply_s)
        return AdapterCommit(version, apply_s)

    async def unload(self, name: str) -> tuple[Adapter, list[AdapterVersion]]:
        """UnloadAdapter: no new request may name it from now on, and (with a state_dir) a restarted server does not
        serve it. Returns it and the versions to unload now (pool.unload_adapters; the others once the sequences on
        them finished)."""
        async with self.pool.push_lock:
            self.registry.check_unload(name)
            if self.registry.durable:
                try:
                    await asyncio.to_thread(self.registry.save, self.registry.snapshot(without=name))
                except OSError as e:
                    raise ServiceError(grpc.StatusCode.INTERNAL,
                                       f"unloading adapter {name!r}: recording it in the state_dir "
                                       f"({self.registry.record_path}) failed ({type(e).__name__}: {e}); nothing "
                                       "changed: it still serves") from e
            return self.registry.unload(name)


def _refused(err: BaseException) -> bool:
    """vLLM refused the adapter itself (its PEFT checks, shapes): the push's fault, not the engine's."""
    return isinstance(err, (ValueError, TypeError)) or any(c.__name__ == "VLLMClientError" for c in type(err).__mro__)
