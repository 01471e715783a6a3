"""Weights over a collective group: InitWeightTransfer, TransferWeights, CloseWeightTransfer.

The transport is vLLM's weight-transfer engine in each worker (engine.weight_transfer: gloo here, nccl / ipc on GPU
nodes); this module orchestrates it as a push: the group's shape (trainer ranks first, then each engine's workers),
the rendezvous under a deadline, and each push validated against the model before a byte moves, then committed by
the WeightCommitter like any push (every engine prepares a shadow while it keeps generating, here receiving into
it; then pause, swap, label, resume; all or none). One engine also writes what it receives to a safetensors file:
the committed record that restarts and rollbacks replay. A push that fails after the engines started receiving
leaves the group unusable (a collective cannot be resumed half-way): it is closed, and the trainer sets it up again.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

import grpc

from rollout_service.engine.base import Engine, EngineState
from rollout_service.errors import Name, ServiceError, about_field, invalid_field
from rollout_service.scratch import scratch_root, take_spare
from rollout_service.weights.service import PushOutcome, WeightService
from rollout_service.wire import ITEMSIZE

log = logging.getLogger(__name__)
BUFFER_BYTES = 64 << 20          # the packed format's chunk size (rollout_client.transfer.DEFAULT_BUFFER_BYTES)
MAX_TRAINER_RANKS = 4096
MAX_BUFFER_BYTES = 16 << 30      # a chunk is held twice (two buffers) on every rank
INIT, PUSH = Name("InitWeightTransfer"), Name("TransferWeights")     # the RPCs, as errors name them


@dataclass
class Group:
    backend: str
    master_address: str
    master_port: int
    trainer_ranks: int
    timeout_s: float
    engines: list[tuple[Engine, int, int]]           # (engine, rank offset, ranks)
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    buffer_bytes: int = BUFFER_BYTES
    joined: bool = False

    @property
    def engine_ranks(self) -> int:
        return sum(n for _, _, n in self.engines)

    @property
    def world_size(self) -> int:
        return self.trainer_ranks + self.engine_ranks

    def init_info(self, offset: int) -> dict:
        if self.backend == "gloo":
            return dict(master_address=self.master_address, master_port=self.master_port, rank_offset=offset,
                        world_size=self.world_size, trainer_ranks=self.trainer_ranks,
                        packed_buffer_size_bytes=self.buffer_bytes, timeout_s=self.timeout_s)
        # vLLM's nccl family: NCCLWeightTransferInitInfo
        return dict(master_address=self.master_address, master_port=self.master_port, rank_offset=offset,
                    world_size=self.world_size, packed=True, packed_buffer_size_bytes=self.buffer_bytes)


@dataclass
class Meta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    src_rank: int = 0


class WeightTransfer:
    def __init__(self, weights: WeightService, backend: str, timeout_s: float):
        self.weights = weights
        self.pool = weights.committer.pool
        self.backend = backend               # the engines' resolved backend ("gloo", "nccl", ...; "none": off)
        self.timeout_s = timeout_s
        self.group: Group | None = None
        self.lock = asyncio.Lock()            # one init, push or close at a time
        self.last_error: tuple = ()           # the last failed push's error (its message's parts)

    def _busy(self, what: str) -> None:
        if self.lock.locked():
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               (Name(what), ": another weight transfer (set-up or push) is in flight; wait for it to "
                                "end"))

    # ---- the group ---------------------------------------------------------------------------------
    async def init(self, backend: str, address: str, port: int, trainer_ranks: int, timeout_s: float,
                   buffer_bytes: int = BUFFER_BYTES, check_shape=None):
        """Yields the group twice: once its shape is fixed (the engines start joining), once every rank joined.

        buffer_bytes: the packed format's chunk size both sides cut by (the vLLM dialect passes the trainer's
        packed_buffer_size_bytes, vLLM's 1 GiB by default). check_shape(group): called with the group's shape
        before anything changes (the current group stays up if it raises), for a caller whose trainer fixed
        the world size itself (vLLM's init_info)."""
        if self.backend == "none":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "weight transfer is off on this server (engine.weight_transfer = none); use PushWeights")
        if backend not in ("", "auto", self.backend):
            raise invalid_field("backend", f"{backend!r}: this server's engines use {self.backend!r} "
                                "(engine.weight_transfer); ask for it, or for \"auto\"", sep=" ")
        if not address:
            raise invalid_field("master_address", "required (where the trainer's rank 0 hosts the group's TCPStore)")
        if not 1 <= port <= 65535:
            raise invalid_field("master_port", f"must be in [1, 65535], got {port}", sep=" ")
        trainer_ranks = trainer_ranks or 1
        if not 1 <= trainer_ranks <= MAX_TRAINER_RANKS:
            raise invalid_field("trainer_ranks", f"must be in [1, {MAX_TRAINER_RANKS}], got {trainer_ranks}", sep=" ")
        if timeout_s < 0:
            raise invalid_field("timeout_s", f"must be >= 0 (0: the server's {self.timeout_s:g} s), got {timeout_s}",
                                sep=" ")
        if not 0 < buffer_bytes <= MAX_BUFFER_BYTES:
            raise invalid_field("buffer_bytes", f"must be in [1, {MAX_BUFFER_BYTES}], got {buffer_bytes}", sep=" ")
        self._busy("InitWeightTransfer")
        async with self.lock:
            engines = list(self.pool.engines)
            not_ready = [e.id for e in engines if e.state not in (EngineState.READY, EngineState.PAUSED)]
            if not_ready:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, (f"engines {not_ready} are not ready (starting or "
                                                                 "restarting); retry ", INIT, " shortly"))
            placed, offset = [], trainer_ranks
            for e in engines:
                placed.append((e, offset, e.transfer_ranks()))
                offset += e.transfer_ranks()
            group = Group(self.backend, address, port, trainer_ranks, timeout_s or self.timeout_s, placed,
                          buffer_bytes=buffer_bytes)
            if check_shape is not None:
                check_shape(group)
            await self._close()
            yield group
            joining = [e.init_transfer(group.init_info(off)) for e, off, _ in placed]
            results = await _bounded(joining, group.timeout_s + 10.0)
            failed = [(e, r) for (e, _, _), r in zip(placed, results) if isinstance(r, BaseException)]
            if failed:
                await asyncio.gather(*(e.close_transfer() for e, _, _ in placed), return_exceptions=True)
                engine, err = failed[0]
                timed_out = isinstance(err, TimeoutError) or "timed out" in str(err).lower() or \
                    "timeout" in str(err).lower()
                code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.INTERNAL
                raise ServiceError(code, (INIT, f": {engine.id} could not join the {self.backend} group at "
                                          f"{address}:{port} (world size {group.world_size}, its rank offset "
                                          f"{dict((e.id, o) for e, o, _ in placed)[engine.id]}): "
                                          f"{_short(err)}. Did every trainer rank 0..{trainer_ranks - 1} join within "
                                          f"{group.timeout_s:g} s? No group is set up; nothing else changed"))
            group.joined = True
            self.group = group
            self.pool.telemetry.transfer_group(group.world_size)
            log.info("weight-transfer group %s (%s) joined: world size %d, %d trainer rank(s), engines at %s",
                     group.group_id, self.backend, group.world_size, trainer_ranks,
                     ", ".join(f"{e.id}:{o}" for e, o, _ in placed))
            yield group

    async def close(self) -> Group | None:
        self._busy("CloseWeightTransfer")
        async with self.lock:
            return await self._close()

    async def _close(self) -> Group | None:
        group, self.group = self.group, None
        if group is not None:
            group.joined = False
            await asyncio.gather(*(e.close_transfer() for e, _, _ in group.engines), return_exceptions=True)
            self.pool.telemetry.transfer_group(0)
            log.info("weight-transfer group %s closed", group.group_id)
        return group

    # ---- a push ------------------------------------------------------------------------------------
    async def push(self, version: int, target: str, mode: str, partial: bool, metas: list[Meta], group_id: str):
        """Yields ("ready", total bytes) once every engine is receiving, then the PushOutcome."""
        t0 = time.perf_counter()
        group = self._check_group(group_id)
        if version <= 0:
            raise invalid_field("version", f"must be > 0, got {version}", sep=" ")
        self.weights.committer.check_version(target, version)
        names, total, kept = self._validate(metas, target, partial, group)
        try:
            missing = self.weights.manifests[target].check_complete(names, partial)
        except ServiceError as e:
            raise ServiceError(e.code, (PUSH, ": ", *e.parts), field=e.field) from None
        self._busy("TransferWeights")
        async with self.lock:
            group = self._check_group(group_id)          # again: a set-up may have replaced it meanwhile
            update_info = {"names": [m.name for m in metas], "dtype_names": [m.dtype for m in metas],
                           "shapes": [list(m.shape) for m in metas]}
            if group.backend == "gloo":
                update_info["src_ranks"] = [m.src_rank for m in metas]
            record = scratch_root() / f"transfer-{uuid.uuid4().hex[:8]}.safetensors"
            await asyncio.to_thread(take_spare, scratch_root(), record)   # its pages are allocated: no faults
            receiving = asyncio.Event()
            listening = set()

            def started(engine_id: str):
                listening.add(engine_id)
                if len(listening) == len(group.engines):
                    receiving.set()

            def prepare(engines):
                ours = [e for e, _, _ in group.engines]
                if set(map(id, engines)) != set(map(id, ours)):
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                       (PUSH, ": the pool changed since the group was set up (engines now "
                                        f"{[e.id for e in engines]}, in the group {[e.id for e in ours]}: one "
                                        "restarted or was scaled); call ", INIT, " again"))
                return [self._prepare_one(e, update_info, target, str(record) if i == 0 else "", started)
                        for i, e in enumerate(engines)]
            t_commit = time.perf_counter()
            commit = asyncio.ensure_future(self.weights.committer.commit(
                [record], kept, version, target, mode, keep_files=False, prepare=prepare))
            ready = asyncio.ensure_future(receiving.wait())
            await asyncio.wait([commit, ready], return_when=asyncio.FIRST_COMPLETED)
            if not receiving.is_set():
                ready.cancel()
                await self._failed(commit, group)           # raises the commit's error
            yield ("ready", total)
            try:
                res = await commit
            except BaseException:
                await self._failed(commit, group)
                raise
            outcome = PushOutcome(res.version, target, len(kept), total, missing, res.prepare_s, 0.0, res.apply_s,
                                  res.pause_s, time.perf_counter() - t0, res.prepare_s)
            log.info("transfer push of %s version %d: %.1f MB in %.3f s (%.2f GB/s; validation %.3f s), paused %.3f s",
                     target, version, total / 1e6, outcome.total_s, total / outcome.total_s / 1e9,
                     t_commit - t0, res.pause_s)
            yield outcome

    async def _prepare_one(self, engine: Engine, update_info: dict, target: str, record: str, started) -> bool:
        await engine.prepare_transfer(update_info, target, record, lambda: started(engine.id))
        return True

    async def _failed(self, commit: asyncio.Future, group: Group) -> None:
        """The push failed: if any engine had started receiving, the group is out of step and is closed. Re-raises
        the commit's error."""
        try:
            await commit
        except ServiceError as e:
            if e.code is not grpc.StatusCode.FAILED_PRECONDITION and self.group is group:
                await self._close()
                self.last_error = e.parts
                raise ServiceError(e.code, (*e.parts, ". The weight-transfer group was closed (a collective cannot "
                                            "resume half-way): call ", INIT, " again"), field=e.field) from None
            raise

    def _check_group(self, group_id: str) -> Group:
        g = self.group
        if g is None or not g.joined:
            why = (" (the last push failed: ", *self.last_error, ")") if self.last_error else ()
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               ("no weight-transfer group is set up", *why, "; call ", INIT, " first"))
        if group_id and group_id != g.group_id:
            raise about_field(grpc.StatusCode.FAILED_PRECONDITION, "group_id",
                              f"{group_id!r} is not the current weight-transfer group ({g.group_id!r}); it was "
                              "replaced or closed: set it up again", sep=" ")
        dead = [e.id for e, _, _ in g.engines if e.state not in (EngineState.READY, EngineState.PAUSED)
                or e not in self.pool.engines]
        if dead:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               (f"engines {dead} left the weight-transfer group (restarted, unhealthy or scaled in); "
                                "call ", INIT, " again"))
        return g

    def _validate(self, metas: list[Meta], target: str, partial: bool, group: Group):
        if not metas:
            raise invalid_field("tensors", "is empty; list every tensor the trainer ranks will send", sep=" ",
                                rpc="TransferWeights")
        manifest = self.weights.manifests[target]
        seen, kept, total = set(), [], 0
        for i, m in enumerate(metas):
            field = f"tensors[{i}]"
            if m.name in seen:
                raise invalid_field(field, f"{m.name!r} is listed twice", sep=" ", rpc="TransferWeights")
            seen.add(m.name)
            if m.dtype not in ITEMSIZE:
                raise invalid_field(field, f"{m.name!r}: dtype {m.dtype!r} unknown; use one of {sorted(ITEMSIZE)}",
                                    sep=" ", rpc="TransferWeights")
            if any(d < 0 for d in m.shape):
                raise invalid_field(field, f"{m.name!r}: negative dimension in shape {list(m.shape)}", sep=" ",
                                    rpc="TransferWeights")
            if not 0 <= m.src_rank < group.trainer_ranks:
                raise invalid_field(field, f"{m.name!r}: src_rank {m.src_rank} is not a trainer rank of the group "
                                           f"(0..{group.trainer_ranks - 1})", sep=" ", rpc="TransferWeights")
            try:
                if manifest.check_tensor(m.name, m.dtype, m.shape):
                    kept.append(m.name)
            except ServiceError as e:            # the manifest's text, about this entry of the request
                raise ServiceError(e.code, (PUSH, ": ", Name(field), " ", *e.parts), field=field) from None
            total += ITEMSIZE[m.dtype] * math.prod(m.shape)
        return list(seen), total, kept


async def _bounded(awaitables: list, timeout_s: float) -> list:
    """gather(return_exceptions=True), each bounded by timeout_s (TimeoutError in its place)."""
    async def one(a):
        return await asyncio.wait_for(a, timeout_s)
    return await asyncio.gather(*(one(a) for a in awaitables), return_exceptions=True)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"[:400]
