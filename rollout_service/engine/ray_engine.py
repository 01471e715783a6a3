"""Engines as Ray actors: the pool (routing, versions, commits) stays in the gRPC process; each engine is a
`VllmEngine` inside an async Ray actor placed with its own placement group.

- Placement: one placement group per engine: `{"CPU": cpus_per_engine}` on CPU machines, or
  `{"GPU": tensor_parallel_size, "CPU": 1}` on GPU nodes (vLLM runs tensor parallelism inside the actor
  on the GPUs Ray gave it).
- Weights: a commit hands every engine the same safetensors file. The front end puts the file's bytes into
  Ray's object store once per commit (`_SharedFile`); each actor reads them from its node's shared memory
  (zero-copy on the same node, one transfer per remote node), writes them to its local /dev/shm and loads
  them. The front end never holds more than one copy, however many engines there are.
- Failure: an actor that dies (its process, its node, or vLLM inside it) is seen by `alive()` through a
  heartbeat; pending `generate` calls fail (UNAVAILABLE, retriable, the request id is released) and the
  supervisor restarts the engine as a new actor at the committed versions (WeightCommitter).
- Cancellation: cancelling `generate` cancels the actor task (`ray.cancel`), which aborts the vLLM request.
- LoRA adapters: an adapter version's PEFT files go through the object store like a commit's weights; each actor
  writes them to a folder of its own node (its scratch folder) and loads them as the vLLM LoRA the pool named. A
  request on the adapter runs on that folder; an actor asked for an adapter it does not hold refuses the request
  (the pool loads every version on every engine before routing to it).
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import ClassVar

import msgspec

from rollout_service.config import EngineConfig
from rollout_service.engine.base import Engine, EngineState
from rollout_service.engine.types import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, SeqRequest, SeqResult

log = logging.getLogger(__name__)
NAMESPACE = "rollout-service"
HEARTBEAT_S = 1.0


class EngineActor:
    """Runs inside the Ray worker: a VllmEngine and the plumbing to feed it."""

    def __init__(self, engine_id: str, model_path: str, cfg: bytes):
        from rollout_service.engine import lifeline
        from rollout_service.engine.vllm_engine import VllmEngine

        lifeline.mark_front_end()      # the engine's processes die with this actor (Ray ends it with the server)
        self.engine = VllmEngine(engine_id, model_path, msgspec.json.decode(cfg, type=EngineConfig))
        self.adapter_dirs: dict[int, Path] = {}   # LoRA id -> its PEFT folder on this node

    async def start(self) -> str:
        await self.engine.start()
        return f"{socket.gethostname()} (pid {os.getpid()})"

    def patch_report(self) -> list[dict]:
        return self.engine.patches

    async def generate(self, req: bytes) -> bytes:
        seq = msgspec.msgpack.decode(req, type=SeqRequest)
        if seq.lora_id:               # the adapter's files on this node, not the front end's path
            folder = self.adapter_dirs.get(seq.lora_id)
            if folder is None:
                raise RuntimeError(f"{self.engine.id}: adapter {seq.lora_name} (LoRA {seq.lora_id}) is not loaded on "
                                   "this engine")
            seq = msgspec.structs.replace(seq, lora_path=str(folder))
        result = await self.engine.generate(seq)
        return msgspec.msgpack.encode(result)

    async def add_adapter(self, name: str, lora_id: int, refs: list) -> None:
        """`refs`: the object-store copies of the version's adapter_config.json and adapter_model.safetensors."""

        config, weights = await asyncio.gather(*refs)       # refs inside a list are not resolved by Ray
        folder = _adapters_root() / str(lora_id)
        await asyncio.to_thread(_write_adapter, folder,
                                {ADAPTER_CONFIG_FILE: config, ADAPTER_WEIGHTS_FILE: weights})
        try:
            await self.engine.add_adapter(name, lora_id, str(folder))
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise
        self.adapter_dirs[lora_id] = folder

    async def remove_adapter(self, lora_id: int) -> None:
        folder = self.adapter_dirs.pop(lora_id, None)
        try:
            await self.engine.remove_adapter(lora_id)
        finally:
            if folder is not None:
                await asyncio.to_thread(shutil.rmtree, folder, True)

    def alive(self) -> bool:
        return self.engine.alive()

    def death_reason(self) -> str:
        return self.engine.death_reason()

    async def pause(self, mode: str) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def load_weights(self, data: bytes, target: str) -> None:
        names = _local_files([data])
        try:
            await self.engine.load_weights(names[0], target)
        finally:
            _remove(names)

    async def prepare_weights(self, refs: list, target: str) -> bool:
        names = _local_files(await asyncio.gather(*refs))   # refs inside a list are not resolved by Ray
        try:
            return await self.engine.prepare_weights(names, target)
        finally:                                       # the prepared weights are copies: the files can go
            _remove(names)

    async def init_transfer(self, init_info: dict) -> int:
        return await self.engine.init_transfer(init_info)

    async def close_transfer(self) -> None:
        await self.engine.close_transfer()

    async def prepare_transfer(self, update_info: dict, target: str, record_path: str) -> None:
        await self.engine.prepare_transfer(update_info, target, record_path, lambda: None)

    async def receive_transfer(self, update_info: dict, record_path: str) -> None:
        await self.engine.receive_transfer(update_info, record_path, lambda: None)

    async def swap_weights(self, target: str) -> None:
        await self.engine.swap_weights(target)

    async def discard_weights(self) -> None:
        await self.engine.discard_weights()

    async def set_versions(self, policy_version: int, draft_version: int) -> None:
        await self.engine.set_versions(policy_version, draft_version)

    async def k_control_snapshot(self) -> dict | None:
        return await self.engine.k_control_snapshot()

    async def shutdown(self) -> None:
        try:
            await self.engine.shutdown()
        finally:
            await asyncio.to_thread(shutil.rmtree, _adapters_root(), True)


def _adapters_root() -> Path:
    """This actor's adapter folders: in its process's scratch folder (removed at shutdown; a killed actor's is swept
    by the next server started on its node, scratch.sweep_stale_roots)."""
    from rollout_service.scratch import scratch_root

    return scratch_root() / "ray-adapters"


def _write_adapter(folder: Path, files: dict[str, bytes]) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(memoryview(data))


def _local_files(datas: list[bytes]) -> list[str]:
    """Write safetensors bytes from the object store to this node's /dev/shm (else the temp dir)."""
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    names = []
    try:
        for data in datas:
            fd, name = tempfile.mkstemp(suffix=".safetensors", dir=folder)
            names.append(name)
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(data))
    except BaseException:
        _remove(names)
        raise
    return names


def _remove(names: list[str]) -> None:
    for name in names:
        Path(name).unlink(missing_ok=True)


class _SharedFile:
    """The object-store copies of the files being committed: one `ray.put` per (path, mtime) set, dropped
    when the next set comes (a commit hands the same files to every engine in turn)."""

    key: tuple | None = None
    refs: ClassVar[list] = []
    lock: ClassVar[asyncio.Lock | None] = None

    @classmethod
    async def get(cls, paths: list[str]) -> list:
        """Reading a model's worth of bytes and copying them into the object store run in a thread (the event
        loop keeps serving); one set at a time (the engines of a commit ask for the same files together)."""
        if cls.lock is None:
            cls.lock = asyncio.Lock()
        async with cls.lock:
            key = await asyncio.to_thread(lambda: tuple((p, os.stat(p).st_mtime_ns, os.stat(p).st_size)
                                                        for p in paths))
            if cls.key != key:
                cls.refs = []
                cls.refs = await asyncio.to_thread(_put_files, paths)
                cls.key = key
            return cls.refs


def _put_files(paths: list[str]) -> list:
    import ray

    return [ray.put(Path(p).read_bytes()) for p in paths]


class RayEngine(Engine):
    """The pool's handle on one EngineActor."""

    starts_apart = True

    def __init__(self, engine_id: str, model_path: str, cfg: EngineConfig, *, cpus: float, gpus: int):
        super().__init__(engine_id)
        self.model_path = model_path
        self.cfg = cfg
        self.cpus, self.gpus = cpus, gpus
        self.actor = None
        self.pg = None
        self._dead = ""
        self._heartbeat: asyncio.Task | None = None

    async def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.state = EngineState.STARTING
        self._dead = ""
        bundle = {"CPU": self.cpus} | ({"GPU": self.gpus} if self.gpus else {})
        self.pg = placement_group([bundle], strategy="STRICT_PACK", name=f"rollout-{self.id}-{time.time_ns()}")
        await self.pg.ready()
        actor_cls = ray.remote(EngineActor)
        self.actor = actor_cls.options(
            num_cpus=self.cpus, num_gpus=self.gpus, max_concurrency=10_000, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0),
        ).remote(self.id, self.model_path, msgspec.json.encode(self.cfg))
        self.location = await self.actor.start.remote()
        self.patches = await self.actor.patch_report.remote()
        self._heartbeat = asyncio.create_task(self._beat())
        self.state = EngineState.READY
        log.info("%s: ready on Ray at %s", self.id, self.location)

    async def _beat(self) -> None:
        while not self._dead:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                ok = await asyncio.wait_for(self.actor.alive.remote(), timeout=30)
                if not ok:
                    self._dead = await self.actor.death_reason.remote() or "vLLM engine died"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - RayActorError, timeout: the actor is gone
                self._dead = f"Ray actor unreachable ({type(e).__name__})"

    def alive(self) -> bool:
        return not self._dead

    def death_reason(self) -> str:
        return self._dead

    async def generate(self, req: SeqRequest, on_delta=None) -> SeqResult:
        """on_delta is never called: the actor returns whole samples (token deltas are not carried over Ray yet;
        a streaming request gets its final samples)."""
        import ray

        ref = self.actor.generate.remote(msgspec.msgpack.encode(req))
        try:
            return msgspec.msgpack.decode(await ref, type=SeqResult)
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        except ray.exceptions.RayActorError as e:
            self._dead = f"Ray actor died ({type(e).__name__})"
            raise RuntimeError(f"{self.id}: engine actor died") from e
        except ray.exceptions.RayTaskError as e:     # an exception inside the actor: re-raise its cause
            raise e.as_instanceof_cause() from None

    async def pause(self, mode: str) -> None:
        self.state = EngineState.PAUSED
        await self.actor.pause.remote(mode)

    async def resume(self) -> None:
        await self.actor.resume.remote()
        self.state = EngineState.READY

    async def load_weights(self, path: str, target: str) -> None:
        await self.actor.load_weights.remote((await _SharedFile.get([path]))[0], target)

    async def prepare_weights(self, paths: list[str], target: str) -> bool:
        if self.cfg.weight_reload == "in_place":
            return False
        return await self.actor.prepare_weights.remote(await _SharedFile.get([str(p) for p in paths]), target)

    # The weight-transfer group: the actor's workers join it from their node. The record (record_path) is written
    # on the actor's node, so the recording engine must share the front end's node (docs/deployment.md).
    async def init_transfer(self, init_info: dict) -> int:
        return await self.actor.init_transfer.remote(init_info)

    def transfer_ranks(self) -> int:
        return self.cfg.tensor_parallel_size

    async def close_transfer(self) -> None:
        await self.actor.close_transfer.remote()

    async def prepare_transfer(self, update_info: dict, target: str, record_path: str, on_receiving) -> None:
        done = self.actor.prepare_transfer.remote(update_info, target, record_path)
        on_receiving()            # the broadcast waits for the actor's workers to listen anyway
        await done

    async def receive_transfer(self, update_info: dict, record_path: str, on_receiving) -> None:
        done = self.actor.receive_transfer.remote(update_info, record_path)
        on_receiving()            # the broadcast waits for the actor's workers to listen anyway
        await done

    async def swap_weights(self, target: str) -> None:
        await self.actor.swap_weights.remote(target)

    async def discard_weights(self) -> None:
        await self.actor.discard_weights.remote()

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:

        refs = await _SharedFile.get([str(Path(path) / ADAPTER_CONFIG_FILE),
                                      str(Path(path) / ADAPTER_WEIGHTS_FILE)])
        await _cause(self.actor.add_adapter.remote(name, lora_id, refs))

    async def remove_adapter(self, lora_id: int) -> None:
        await _cause(self.actor.remove_adapter.remote(lora_id))

    async def set_versions(self, policy_version: int, draft_version: int) -> None:
        await self.actor.set_versions.remote(policy_version, draft_version)
        self.policy_version, self.draft_version = policy_version, draft_version

    async def k_control_snapshot(self) -> dict | None:
        return await self.actor.k_control_snapshot.remote()

    async def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if self.actor is not None:
            try:
                if not self._dead:
                    await asyncio.wait_for(self.actor.shutdown.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - a dead or stuck actor is killed below
                log.warning("%s: actor did not shut down cleanly (%s); killing it", self.id, type(e).__name__)
            ray.kill(self.actor, no_restart=True)
            self.actor = None
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self.state = EngineState.STOPPED


async def _cause(ref):
    """Await an actor call; an exception inside the actor is re-raised as its cause (vLLM's refusal of an adapter
    stays a ValueError: the push's fault, not the engine's)."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None


def actor_env(environ=os.environ) -> dict[str, str]:
    """The variables the front end hands its engine actors: every VLLM_* and ROLLOUT_* one except the lifeline's
    mark (the front end's pid on its own machine). On another node or container that pid is some other process:
    the actor's lifeline took it for a dead front end and SIGKILLed what it found under it there, Ray's raylet
    included (the compose stack's worker, docs/deployment.md). An actor marks itself (EngineActor)."""
    from rollout_service.engine.lifeline import ENV

    return {k: v for k, v in environ.items() if k.startswith(("VLLM_", "ROLLOUT_")) and k != ENV}


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ("auto": the local one) from the gRPC process."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True, runtime_env={"env_vars": actor_env()})
