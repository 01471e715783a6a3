"""Weights over a collective group: InitWeightTransfer, TransferWeights, CloseWeightTransfer.

The transport is vLLM's weight-transfer engine in each worker (engine.weight_transfer: gloo here, nccl / ipc on GPU
nodes); this module orchestrates it as a push: the group's shape (trainer ranks first, then each engine's workers),
the rendezvous under a deadline, and each push validated against the model before a byte moves, then committed by
the WeightCommitter like any push (every engine prepares a shadow while it keeps generating, here receiving into
it; then pause, swap, label, resume; all or none). One engine also writes what it receives to a safetensors file:
the committed record that restarts and rollbacks replay. A push that fails after the engines started receiving
leaves the group unusable (a collective cannot be resumed half-way): it is closed, and the trainer sets it up again.

A LoRA adapter (target "adapter") moves the same way and commits as a push does: its config and tensors are checked
before a byte moves, every engine receives the tensors without loading them into a model (one records them), and
the record becomes the version's PEFT directory, committed on every engine or on none (weights/adapter_commit.py).
A commit that fails after every engine received (an engine refusing the adapter) leaves the group in step.
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
from rollout_service.hosts import allowed_networks, host_problem, outside, peer_ip
from rollout_service.validation import number_problem
from rollout_service.scratch import scratch_root, take_spare
from rollout_service.weights.service import PushOutcome, WeightService
from rollout_service.wire import ITEMSIZE

log = logging.getLogger(__name__)
BUFFER_BYTES = 64 << 20          # the packed format's chunk size (rollout_client.transfer.DEFAULT_BUFFER_BYTES)
MAX_TRAINER_RANKS = 1024         # engine.weight_transfer_max_ranks' default
MAX_TIMEOUT_S = 600.0            # engine.weight_transfer_max_timeout_s' default
MAX_BUFFER_BYTES = 16 << 30      # a chunk is held twice (two buffers) on every rank
RESOLVE_TIMEOUT_S = 5.0          # resolving master_address (and host names of security.weight_transfer_hosts)
WATCH_S = 1.0                    # how often a joined group's rendezvous (the trainer's rank 0) is checked
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
    dial: str = ""                                   # the address the engines dial (master_address, resolved)

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
    def __init__(self, weights: WeightService, backend: str, timeout_s: float, *, max_timeout_s: float = MAX_TIMEOUT_S,
                 max_ranks: int = MAX_TRAINER_RANKS, allowed_hosts: list[str] | None = None, watch: bool = True):
        self.weights = weights
        self.pool = weights.committer.pool
        self.backend = backend               # the engines' resolved backend ("gloo", "nccl", ...; "none": off)
        self.timeout_s = timeout_s           # engine.weight_transfer_timeout_s: a set-up's timeout_s = 0
        self.max_timeout_s = max(max_timeout_s, timeout_s)
        self.max_ranks = max_ranks
        self.allowed_hosts = list(allowed_hosts or [])    # security.weight_transfer_hosts ([]: the caller's address)
        self.group: Group | None = None
        self.lock = asyncio.Lock()            # one init, push or close at a time
        self.last_error: tuple = ()           # why the last group closed, or the last failed push's error
        self.settling: asyncio.Task | None = None   # an abandoned set-up or push the engines are still finishing
        self.watch = watch                    # check that a joined group's trainer is still there (_watch)
        self._watcher: asyncio.Task | None = None

    @classmethod
    def from_config(cls, weights: WeightService, backend: str, cfg) -> WeightTransfer:
        """From a ServerConfig: engine.weight_transfer_* and security.weight_transfer_hosts."""
        e = cfg.engine
        return cls(weights, backend, e.weight_transfer_timeout_s, max_timeout_s=e.weight_transfer_max_timeout_s,
                   max_ranks=e.weight_transfer_max_ranks, allowed_hosts=cfg.security.weight_transfer_hosts)

    def _busy(self, what: str) -> None:
        if self.lock.locked():
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               (Name(what), ": another weight transfer (set-up or push) is in flight; wait for it to "
                                "end"))
        if self.settling is not None and not self.settling.done():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               (Name(what), ": the engines are still ending an abandoned weight-transfer set-up or "
                                "push (they wait at most its timeout_s for ranks that went away); retry in a few "
                                "seconds"))

    # ---- the group ---------------------------------------------------------------------------------
    def check_init(self, backend: str, address: str, port: int, trainer_ranks: int, timeout_s: float,
                   buffer_bytes: int = BUFFER_BYTES) -> tuple[int, float]:
        """A set-up's fields, each checked before anything happens (INVALID_ARGUMENT naming the field).
        Returns (trainer ranks, timeout in seconds) with the defaults filled in."""
        if self.backend == "none":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "weight transfer is off on this server (engine.weight_transfer = none); use PushWeights")
        if backend not in ("", "auto", self.backend):
            raise invalid_field("backend", f"{backend!r}: this server's engines use {self.backend!r} "
                                "(engine.weight_transfer); ask for it, or for \"auto\"", sep=" ")
        problem = host_problem(address)
        if problem:
            raise invalid_field("master_address", problem)
        if not 1 <= port <= 65535:
            raise invalid_field("master_port", f"must be in [1, 65535], got {port}", sep=" ")
        trainer_ranks = trainer_ranks or 1
        if not 1 <= trainer_ranks <= self.max_ranks:
            raise invalid_field("trainer_ranks", f"must be in [1, {self.max_ranks}] (engine.weight_transfer_max_"
                                f"ranks), got {trainer_ranks}", sep=" ")
        if timeout_s != 0:
            problem = number_problem(timeout_s, 0.0, self.max_timeout_s, " seconds (engine.weight_transfer_max_"
                                     f"timeout_s; 0: the server's {self.timeout_s:g} s)")
            if problem:
                raise invalid_field("timeout_s", problem, sep=" ")
        if not 0 < buffer_bytes <= MAX_BUFFER_BYTES:
            raise invalid_field("buffer_bytes", f"must be in [1, {MAX_BUFFER_BYTES}], got {buffer_bytes}", sep=" ")
        return trainer_ranks, timeout_s or self.timeout_s

    async def check_reach(self, address: str, port: int, caller: str | None) -> str:
        """Where the engines will dial: master_address resolved here, every address it resolves to allowed by
        security.weight_transfer_hosts (by default the caller's own address), else PERMISSION_DENIED naming
        master_address. Returns the first address, which the engines are given (so a name cannot resolve
        elsewhere for them). caller: the caller's peer ("ipv4:10.0.0.5:53412", an HTTP client's host); None:
        a caller inside this process, not checked."""
        ips = await _resolve(address, port)
        if not ips:
            raise invalid_field("master_address", f"{address!r} does not resolve to an address here", sep=" ")
        if caller is None:
            return str(ips[0])
        names = [h for h in self.allowed_hosts if h != "caller" and not _is_network(h)]
        resolved = {h: [n.network_address for n in await _resolve(h, port, networks=True)] for h in names}
        nets = allowed_networks(self.allowed_hosts, peer_ip(caller), lambda h: resolved.get(h, []))
        denied = outside(ips, nets)
        if denied:
            allowed = ", ".join(self.allowed_hosts) if self.allowed_hosts else f"the caller's own address ({caller})"
            raise about_field(grpc.StatusCode.PERMISSION_DENIED, "master_address",
                              f"{address!r} resolves to {', '.join(map(str, denied))}, which this server's engines "
                              f"may not reach: allowed are {allowed} (security.weight_transfer_hosts). Host the "
                              "group's rendezvous on the trainer that calls, or ask the operator to allow the address",
                              sep=" ")
        return str(ips[0])

    async def init(self, backend: str, address: str, port: int, trainer_ranks: int, timeout_s: float,
                   buffer_bytes: int = BUFFER_BYTES, check_shape=None, *, caller: str | None = None):
        """Yields the group twice: once its shape is fixed (the engines start joining), once every rank joined.

        buffer_bytes: the packed format's chunk size both sides cut by (the vLLM dialect passes the trainer's
        packed_buffer_size_bytes, vLLM's 1 GiB by default). check_shape(group): called with the group's shape
        before anything changes (the current group stays up if it raises), for a caller whose trainer fixed
        the world size itself (vLLM's init_info). caller: the caller's address (check_reach)."""
        trainer_ranks, timeout_s = self.check_init(backend, address, port, trainer_ranks, timeout_s, buffer_bytes)
        dial = await self.check_reach(address, port, caller)
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
            group = Group(self.backend, address, port, trainer_ranks, timeout_s, placed, buffer_bytes=buffer_bytes,
                          dial=dial)
            if check_shape is not None:
                check_shape(group)
            await self._close()
            yield group
            info = [group.init_info(off) | {"master_address": dial} for _, off, _ in placed]
            joining = asyncio.ensure_future(_bounded([e.init_transfer(i) for (e, _, _), i in zip(placed, info)],
                                                     group.timeout_s + 10.0))
            try:
                results = await asyncio.shield(joining)
            except BaseException:             # the caller went away: the engines end the join by its timeout
                self.settling = asyncio.ensure_future(self._settle(joining, placed))
                raise
            failed = [(e, r) for (e, _, _), r in zip(placed, results) if isinstance(r, BaseException)]
            if failed:
                await asyncio.gather(*(e.close_transfer() for e, _, _ in placed), return_exceptions=True)
                engine, err = failed[0]
                code, advice = self._join_failure(engine, err, group)
                raise ServiceError(code, (INIT, f": {engine.id} could not join the {self.backend} group at "
                                          f"{address}:{port} (world size {group.world_size}, its rank offset "
                                          f"{dict((e.id, o) for e, o, _ in placed)[engine.id]}): "
                                          f"{_short(err)}. {advice} No group is set up; nothing else changed"))
            group.joined = True
            self.group = group
            self.last_error = ()
            if self.watch:
                self._watcher = asyncio.ensure_future(self._watch(group))
            self.pool.telemetry.transfer_group(group.world_size)
            log.info("weight-transfer group %s (%s) joined: world size %d, %d trainer rank(s), engines at %s",
                     group.group_id, self.backend, group.world_size, trainer_ranks,
                     ", ".join(f"{e.id}:{o}" for e, o, _ in placed))
            yield group

    async def close(self) -> Group | None:
        self._busy("CloseWeightTransfer")
        async with self.lock:
            return await self._close()

    async def _close(self, why: str = "") -> Group | None:
        group = self._forget(why)
        if group is not None:
            await asyncio.gather(*(e.close_transfer() for e, _, _ in group.engines), return_exceptions=True)
        return group

    def _forget(self, why: str = "") -> Group | None:
        """The current group is closed as of now (GetStatus, the next push); the engines leave it after."""
        group, self.group = self.group, None
        if group is not None:
            group.joined = False
            self.pool.telemetry.transfer_group(0)
            if why:
                self.last_error = (f"group {group.group_id} was closed: {why}",)
            log.log(logging.WARNING if why else logging.INFO, "weight-transfer group %s closed%s", group.group_id,
                    f": {why}" if why else "")
        return group

    async def _settle(self, work: asyncio.Future, engines) -> None:
        """An abandoned set-up or push: let the engines end it (bounded by its timeout), then leave the group."""
        try:
            await work
        except BaseException:  # noqa: BLE001 - its outcome has nobody to go to; it is logged by the commit
            pass
        await asyncio.gather(*(e.close_transfer() for e, _, _ in engines), return_exceptions=True)

    async def _watch(self, group: Group) -> None:
        """Close a joined group once its trainer is gone: its rank 0 hosts the rendezvous (a TCP listener) for the
        group's life, so a refused connection there means the trainer exited or was killed."""
        while self.group is group:
            await asyncio.sleep(WATCH_S)
            if self.group is not group or self.lock.locked():    # a push in flight fails by itself
                continue
            if not await _answers(group.dial, group.master_port):
                async with self.lock:
                    if self.group is group and not await _answers(group.dial, group.master_port):
                        await self._close(f"the trainer's rendezvous at {group.master_address}:{group.master_port} "
                                          "stopped answering (its rank 0 exited or was killed)")

    # ---- a push ------------------------------------------------------------------------------------
    async def push(self, version: int, target: str, mode: str, partial: bool, metas: list[Meta], group_id: str, *,
                   adapter: str = "", adapter_config: str = ""):
        """Yields ("ready", total bytes) once every engine is receiving, then the PushOutcome. target "adapter":
        version `version` of LoRA adapter `adapter` (PEFT's `adapter_config` and tensors)."""
        t0 = time.perf_counter()
        if target == "adapter":
            async for item in self._push_adapter(version, adapter, adapter_config, partial, metas, group_id, t0):
                yield item
            return
        if adapter or adapter_config:
            raise invalid_field("adapter" if adapter else "adapter_config", "is for TARGET_ADAPTER transfers only",
                                sep=" ", rpc="TransferWeights")
        group = self._check_group(group_id)
        if version <= 0:
            raise invalid_field("version", f"must be > 0, got {version}", sep=" ")
        self.weights.committer.check_version(target, version)
        names, total, kept = self._validate(metas, self.weights.manifests[target], group)
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

            def prepare(engines, fill):
                ours = [e for e, _, _ in group.engines]
                if set(map(id, engines)) != set(map(id, ours)):
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                       (PUSH, ": the pool changed since the group was set up (engines now "
                                        f"{[e.id for e in engines]}, in the group {[e.id for e in ours]}: one "
                                        "restarted or was scaled); call ", INIT, " again"))
                info = update_info | {"rollout_fill": [str(f) for f in fill]}   # the rest of the layers it touches
                return [self._prepare_one(e, info, target, str(record) if i == 0 else "", started)
                        for i, e in enumerate(engines)]
            if self.watch and not await _answers(group.dial, group.master_port):
                await self._close(f"the trainer's rendezvous at {group.master_address}:{group.master_port} does "
                                  "not answer (its rank 0 exited or was killed)")
                self._check_group(group_id)                  # FAILED_PRECONDITION, saying why
            t_commit = time.perf_counter()
            commit = asyncio.ensure_future(self.weights.committer.commit(
                [record], kept, version, target, mode, keep_files=False, prepare=prepare))
            ready = asyncio.ensure_future(receiving.wait())
            try:
                await asyncio.wait([commit, ready], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                self._abandon(group, commit, ready)
                raise
            if not receiving.is_set():
                ready.cancel()
                await self._failed(commit, group, target, bool(listening))   # raises the commit's error
            try:
                yield ("ready", total)
                res = await asyncio.shield(commit)
            except (asyncio.CancelledError, GeneratorExit):
                self._abandon(group, commit, ready)
                raise
            except Exception:  # noqa: BLE001 - the commit's failure, as a status the trainer can act on
                await self._failed(commit, group, target, True)
                raise
            outcome = PushOutcome(res.version, target, len(kept), total, missing, res.prepare_s, 0.0, res.apply_s,
                                  res.pause_s, time.perf_counter() - t0, res.prepare_s, fingerprint=res.fingerprint)
            log.info("transfer push of %s version %d: %.1f MB in %.3f s (%.2f GB/s; validation %.3f s), paused %.3f s",
                     target, version, total / 1e6, outcome.total_s, total / outcome.total_s / 1e9,
                     t_commit - t0, res.pause_s)
            yield outcome

    async def _push_adapter(self, version: int, name: str, config: str, partial: bool, metas: list[Meta],
                            group_id: str, t0: float):
        group = self._check_group(group_id)
        if partial:
            raise invalid_field("partial", "an adapter is transferred whole; leave it false", sep=" ",
                                rpc="TransferWeights")
        spec = self.weights.adapter_spec(name, version, config, "", "TransferWeights")
        names, total, _ = self._validate(metas, spec.manifest, group)
        try:
            spec.manifest.check_complete(names, False)
        except ServiceError as e:
            raise ServiceError(e.code, (PUSH, ": ", *e.parts), field=e.field) from None
        self._busy("TransferWeights")
        async with self.lock:
            group = self._check_group(group_id)          # again: a set-up may have replaced it meanwhile
            engines = [e for e, _, _ in group.engines]
            update_info = {"names": [m.name for m in metas], "dtype_names": [m.dtype for m in metas],
                           "shapes": [list(m.shape) for m in metas]}
            if group.backend == "gloo":
                update_info["src_ranks"] = [m.src_rank for m in metas]
            folder = scratch_root() / "adapter-staging"
            await asyncio.to_thread(folder.mkdir, exist_ok=True)
            record = folder / f"transfer-{uuid.uuid4().hex[:8]}.safetensors"
            receiving = asyncio.Event()
            listening = set()

            def started(engine_id: str):
                listening.add(engine_id)
                if len(listening) == len(engines):
                    receiving.set()

            async def receive_all():
                results = await asyncio.gather(*(e.receive_transfer(update_info, str(record) if i == 0 else "",
                                                                    lambda e=e: started(e.id))
                                                 for i, e in enumerate(engines)), return_exceptions=True)
                for r in results:                        # every engine ended its part; the first failure
                    if isinstance(r, BaseException):
                        raise r

            def drop_record(_future=None):               # a push that commits nothing: its record goes
                asyncio.get_running_loop().run_in_executor(None, record.unlink, True)
            if self.watch and not await _answers(group.dial, group.master_port):
                await self._close(f"the trainer's rendezvous at {group.master_address}:{group.master_port} does "
                                  "not answer (its rank 0 exited or was killed)")
                self._check_group(group_id)                  # FAILED_PRECONDITION, saying why
            serving = _adapter_serving(self.pool.adapters, name)
            received = asyncio.ensure_future(receive_all())
            ready = asyncio.ensure_future(receiving.wait())
            try:
                await asyncio.wait([received, ready], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                self._abandon(group, received, ready)
                received.add_done_callback(drop_record)
                raise
            if not receiving.is_set():
                ready.cancel()
                try:
                    await self._failed(received, group, "adapter", bool(listening), serving)
                finally:
                    drop_record()
            t_receive = time.perf_counter()
            try:
                yield ("ready", total)
                await asyncio.shield(received)
            except (asyncio.CancelledError, GeneratorExit):
                self._abandon(group, received, ready)
                received.add_done_callback(drop_record)
                raise
            except Exception:  # noqa: BLE001 - the receive's failure, as a status the trainer can act on
                try:
                    await self._failed(received, group, "adapter", True, serving)
                finally:
                    drop_record()
                raise
            receive_s = time.perf_counter() - t_receive
            # every engine received: the group is in step whatever the commit does; the commit runs to its end
            res = await asyncio.shield(asyncio.ensure_future(self._commit_adapter(name, version, spec, record, total)))
            outcome = PushOutcome(res.version, "adapter", len(names), total, False, receive_s, 0.0, res.apply_s, 0.0,
                                  time.perf_counter() - t0, 0.0, adapter=name)
            log.info("transfer push of adapter %s version %d: %.2f MB received in %.3f s, loaded in %.3f s", name,
                     version, total / 1e6, receive_s, res.apply_s)
            yield outcome

    async def _commit_adapter(self, name, version, spec, record, total):
        """The received record becomes the version's PEFT directory (moved), committed on every engine or on none;
        a record the commit did not take is removed."""
        try:
            return await self.weights.adapters.commit(name, version, spec, record, total, "", keep_file=False)
        finally:
            await asyncio.to_thread(record.unlink, True)

    async def _prepare_one(self, engine: Engine, update_info: dict, target: str, record: str, started) -> bool:
        await engine.prepare_transfer(update_info, target, record, lambda: started(engine.id))
        return True

    def _abandon(self, group: Group, commit: asyncio.Future, ready: asyncio.Future) -> None:
        """The caller went away mid-push (its trainer was killed, or it cancelled): the group is out of step from
        now on. The commit runs to its end (all or none, as always); then the engines leave the group."""
        ready.cancel()
        if self.group is group:
            self._forget("the trainer's TransferWeights call ended before the push did (the trainer went away or "
                         "cancelled it)")
        self.settling = asyncio.ensure_future(self._settle(commit, group.engines))

    async def _failed(self, commit: asyncio.Future, group: Group, target: str, started: bool,
                      serving: str = "") -> None:
        """The push failed: raises its error as a status a trainer can act on. If any engine had started
        receiving, the group is out of step and is closed. serving: what still serves (default: the target's
        committed version)."""
        try:
            await asyncio.shield(commit)
        except ServiceError as e:
            if e.code is grpc.StatusCode.FAILED_PRECONDITION and not started:
                raise                                   # refused before anything moved: the group is in step
            err: BaseException = e
        except Exception as e:  # noqa: BLE001 - whatever failed, the trainer gets a status it can act on
            err = e
        else:
            return
        code, parts = self._push_failure(err, group, target, serving)
        if self.group is group:
            await self._close()
        self.last_error = parts
        raise ServiceError(code, (*parts, ". The weight-transfer group was closed (a collective cannot resume "
                                  "half-way): call ", INIT, " again, then push again"),
                           field=getattr(err, "field", None)) from None

    # ---- what a failure inside an engine means to the trainer ----------------------------------------
    def _dead(self, group: Group) -> list[str]:
        return [e.id for e, _, _ in group.engines if not e.alive() or e.state not in (EngineState.READY,
                                                                                       EngineState.PAUSED)]

    def _join_failure(self, engine: Engine, err: BaseException, group: Group) -> tuple[grpc.StatusCode, str]:
        text = str(err)
        if self._dead(group) or "EngineDead" in text or "engine core died" in text:
            return (grpc.StatusCode.UNAVAILABLE, f"An engine died ({', '.join(self._dead(group)) or engine.id}); "
                    "the pool restarts it at the committed version: retry once GetStatus shows every engine ready.")
        if "still joining" in text:
            return (grpc.StatusCode.UNAVAILABLE, "A set-up abandoned earlier is still waiting for its ranks "
                    "(at most its timeout_s); retry in a few seconds.")
        if _timed_out(err):
            return (grpc.StatusCode.DEADLINE_EXCEEDED, f"Did every trainer rank 0..{group.trainer_ranks - 1} join "
                    f"within {group.timeout_s:g} s? Start them, then call InitWeightTransfer again.")
        return (grpc.StatusCode.UNAVAILABLE, f"Nothing at {group.master_address}:{group.master_port} answered as "
                "the group's rendezvous: start the trainer's rank 0 there first (it hosts the TCPStore), then call "
                "InitWeightTransfer again.")

    def _push_failure(self, err: BaseException, group: Group, target: str,
                      serving: str = "") -> tuple[grpc.StatusCode, tuple]:
        serving = serving or f"{target} version {self.pool.versions.get(target, 0)}"
        dead = self._dead(group)
        text = str(err)
        if dead or "EngineDead" in text or "engine core died" in text:
            return grpc.StatusCode.UNAVAILABLE, (
                PUSH, f": engine {', '.join(dead) or '?'} died during the transfer ({_short(err)}); it is restarted at "
                f"the committed version ({serving} serves on every ready engine). Retry once GetStatus shows every "
                "engine ready")
        if _timed_out(err):
            return grpc.StatusCode.DEADLINE_EXCEEDED, (
                PUSH, f": the engines waited {group.timeout_s:g} s for the trainer's tensors and gave up "
                f"({_short(err)}); did every trainer rank send after `ready`? Nothing was applied: {serving} serves")
        return grpc.StatusCode.ABORTED, (
            PUSH, f": the transfer broke off ({_short(err)}), as when a trainer rank goes away mid-push; nothing "
            f"was applied: {serving} serves")

    def _check_group(self, group_id: str) -> Group:
        g = self.group
        if g is None or not g.joined:
            why = (" (", *self.last_error, ")") if self.last_error else ()
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

    def _validate(self, metas: list[Meta], manifest, group: Group):
        if not metas:
            raise invalid_field("tensors", "is empty; list every tensor the trainer ranks will send", sep=" ",
                                rpc="TransferWeights")
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


def _adapter_serving(registry, name: str) -> str:
    a = registry.adapters.get(name)
    return (f"adapter {name!r} version {a.latest}" if a is not None and a.latest and not a.unloading
            else f"no version of adapter {name!r}")


async def _bounded(awaitables: list, timeout_s: float) -> list:
    """gather(return_exceptions=True), each bounded by timeout_s (TimeoutError in its place)."""
    async def one(a):
        return await asyncio.wait_for(a, timeout_s)
    return await asyncio.gather(*(one(a) for a in awaitables), return_exceptions=True)


def _is_network(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


def _timed_out(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, TimeoutError) or "timed out" in text or "timeout" in text or "deadline" in text


async def _resolve(host: str, port: int, networks: bool = False) -> list:
    """The IP addresses `host` resolves to (without blocking the event loop; [] when it does not resolve)."""
    import ipaddress
    import socket

    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S)
    except (OSError, TimeoutError, UnicodeError, ValueError):
        return []
    out = []
    for *_, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        ip = (ip.ipv4_mapped or ip) if ip.version == 6 else ip
        item = ipaddress.ip_network(ip) if networks else ip
        if item not in out:
            out.append(item)
    return out


async def _answers(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether something listens at host:port (the trainer's rendezvous). A slow answer counts as one."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except TimeoutError:
        return True
    except OSError:
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"[:400]
