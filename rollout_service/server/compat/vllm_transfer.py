"""vLLM's weight-transfer endpoints (vllm/entrypoints/rl/online/api_router.py) on the service's WeightTransfer
(weights/transfer.py), so a trainer written for vLLM's weight transfer (TRL's async GRPO WeightTransferClient)
works unchanged:

    POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size,
                                                     packed, packed_buffer_size_bytes}}   -> the group, joined
    POST /start_weight_update {"is_checkpoint_format": true}    (or /start_draft_weight_update: the drafter)
    POST /update_weights {"update_info": {names, dtype_names, shapes}}   -> one committed push
    POST /finish_weight_update {"weight_version": ...}
    POST /shutdown_weight_transfer_engine

The trainer hosts the group's TCPStore as rank 0 and broadcasts while /update_weights is in flight, in vLLM's
packed format (chunks cut by packed_buffer_size_bytes, vLLM's 1 GiB by default); the engines use the server's
backend (gloo on CPU, nccl on GPUs). Each /update_weights is validated against the model, received into the
shadow, and committed all-or-none as the next version of the open update's target; it answers once committed.
"""
from __future__ import annotations

import contextlib
import logging

from rollout_service.errors import ServiceError
from rollout_service.server.compat.dialect import DialectError, Fields, from_service_error
from rollout_service.weights.transfer import Meta

log = logging.getLogger(__name__)
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30     # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES (packed_tensor.py)
# the contract's names (InitWeightTransfer's, TransferWeights' and their fields) as vLLM's endpoints spell them
SPELLING = {"InitWeightTransfer": "POST /init_weight_transfer_engine", "TransferWeights": "POST /update_weights",
            "CloseWeightTransfer": "POST /shutdown_weight_transfer_engine",
            "master_address": "init_info.master_address", "master_port": "init_info.master_port",
            "trainer_ranks": "init_info.rank_offset", "timeout_s": "init_info.timeout_s",
            "buffer_bytes": "init_info.packed_buffer_size_bytes", "tensors": "update_info.names"}
INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "packed", "packed_buffer_size_bytes",
               "packed_num_buffers", "nccl_unique_id_b64", "timeout_s"}
# vLLM 0.32's update_info is names, dtype_names, shapes; earlier releases carried the packing in it too, as OpenPipe
# ART 0.5.18 still sends it (packed, packed_buffer_size_bytes, packed_num_buffers): accepted where it agrees with
# the group
UPDATE_FIELDS = {"names", "dtype_names", "shapes", "packed", "is_checkpoint_format", "packed_buffer_size_bytes",
                 "packed_num_buffers"}


def _unknown(body: dict, known: set[str], where: str) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise DialectError(400, f"{where}.{extra[0]}: not a field of vLLM's {where} "
                                f"(known: {', '.join(sorted(known))})",
                           f"{where}.{extra[0]}")


def _required(f: Fields, key: str, kind: str):
    v = getattr(f, kind)(key)
    if v is None:
        raise DialectError(400, f"{f.prefix}{key}: required", f.prefix + key)
    return v


class VllmWeightTransfer:
    """The dialect's state over WeightTransfer: which update is open (start .. finish) and what it committed."""

    def __init__(self, service):
        self.service = service                  # server/service.py's RolloutService, as gRPC's servicer calls it
        self.open: str | None = None            # the target of the update between start and finish
        self.committed: int | None = None       # the version the open update committed

    @property
    def transfer(self):                         # weights/transfer.py's WeightTransfer (InitWeightTransfer's too)
        return self.service.transfer

    @property
    def weights(self):
        return self.service.weights

    @property
    def pool(self):
        return self.service.pool

    @property
    def model(self):
        return self.service.model

    # ---- reads --------------------------------------------------------------------------------------------
    def world_size(self) -> int:
        """The engines' worker ranks in a weight-transfer group (vLLM's /get_world_size: without the trainer)."""
        return sum(e.transfer_ranks() for e in self.pool.engines)

    def server_info(self) -> dict:
        """The part of vLLM's /server_info?config_format=json that trainers read: the serving dtype, and the
        log-probs' mode (TRL's GRPO trainer checks it is processed_logprobs, which the engines run with)."""
        manifest = self.weights.manifests.get("policy")
        model = self.model
        dtype = f"torch.{manifest.serving_dtype}" if manifest is not None else None
        return {"vllm_config": {"model_config": {"model": model.path, "dtype": dtype,
                                                 "max_model_len": model.max_model_len,
                                                 "logprobs_mode": "processed_logprobs"},
                                "weight_transfer_config": {"backend": self.transfer.backend}}}

    # ---- the group ----------------------------------------------------------------------------------------
    async def init(self, body: dict, caller: str | None = None) -> dict:
        """Set up the group with the trainer's init_info; answers once every engine joined it. caller: the
        client's address (where the group may reach: WeightTransfer.check_reach)."""
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise DialectError(400, "init_info: required, an object (vLLM's init_info: master_address, master_port, "
                                    "rank_offset, world_size, packed)", "init_info")
        _unknown(info, INIT_FIELDS, "init_info")
        f = Fields(info, "init_info.")
        if info.get("nccl_unique_id_b64") is not None:
            raise DialectError(400, "init_info.nccl_unique_id_b64: the unique-id rendezvous is not served; give "
                                    "master_address and master_port (the trainer's rank 0 hosts the TCPStore)",
                               "init_info.nccl_unique_id_b64")
        address = _required(f, "master_address", "get")
        if not isinstance(address, str) or not address:
            raise DialectError(400, "init_info.master_address: must be a host name or address",
                               "init_info.master_address")
        port = _required(f, "master_port", "int")
        rank_offset = _required(f, "rank_offset", "int")
        world_size = _required(f, "world_size", "int")
        if not f.bool("packed", True):
            raise DialectError(400, "init_info.packed: must be true; this service moves weights in vLLM's packed "
                                    "format only", "init_info.packed")
        buffer_bytes = f.int("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES)
        if buffer_bytes <= 0:
            raise DialectError(400, f"init_info.packed_buffer_size_bytes: must be > 0, got {buffer_bytes}",
                               "init_info.packed_buffer_size_bytes")
        num_buffers = f.int("packed_num_buffers", 2)       # how many chunks are in flight: not on the wire
        if num_buffers < 1:
            raise DialectError(400, f"init_info.packed_num_buffers: must be >= 1, got {num_buffers}",
                               "init_info.packed_num_buffers")
        timeout_s = f.float("timeout_s", 0.0)
        if rank_offset < 1:
            raise DialectError(400, f"init_info.rank_offset: must be >= 1 (the trainer's ranks come first: "
                                    f"rank_offset is their number), got {rank_offset}", "init_info.rank_offset")

        def check_shape(group):
            if world_size != group.world_size:
                raise DialectError(400, f"init_info.world_size: must be {group.world_size} (rank_offset "
                                        f"{group.trainer_ranks} trainer rank(s) + {group.engine_ranks} engine "
                                        f"rank(s); GET /get_world_size gives the engines'), got {world_size}",
                                   "init_info.world_size")
        group = None
        try:
            async for group in self.transfer.init("auto", address, port, rank_offset, timeout_s,
                                                  buffer_bytes=buffer_bytes, check_shape=check_shape, caller=caller):
                self.open = self.committed = None       # a new group: no update is open over it
        except ServiceError as e:
            raise from_service_error(e, SPELLING) from None
        return {"message": "Weight transfer initialized", "backend": group.backend, "group_id": group.group_id,
                "world_size": group.world_size, "trainer_ranks": group.trainer_ranks,
                "engine_ranks": group.engine_ranks, "packed_buffer_size_bytes": group.buffer_bytes,
                "engines": [{"engine": e.id, "rank_offset": o, "ranks": n} for e, o, n in group.engines]}

    async def shutdown(self) -> dict:
        try:
            await self.transfer.close()
        except ServiceError as e:
            raise from_service_error(e, SPELLING) from None
        self.open = self.committed = None
        return {"message": "Weight transfer shut down"}

    # ---- an update: start, update_weights, finish ---------------------------------------------------------
    def start(self, target: str, body: dict) -> dict:
        if not Fields(body).bool("is_checkpoint_format", True):
            raise DialectError(400, "is_checkpoint_format: must be true; the weights are checked and loaded by "
                                    "their Hugging Face (checkpoint) names", "is_checkpoint_format")
        if self.open is not None:
            raise DialectError(409, f"a weight update of the {self.open} is already open; POST "
                                    "/finish_weight_update first")
        g = self.transfer.group
        if g is None or not g.joined:
            raise DialectError(409, "no weight-transfer group is set up; POST /init_weight_transfer_engine first")
        if target not in self.weights.manifests:
            raise DialectError(409, f"this server has no {target} to update (start it with speculation configured)")
        self.open, self.committed = target, None
        return {"message": "Draft weight update started" if target == "draft" else "Weight update started"}

    async def update(self, info) -> dict:
        """One push over the group: the next version of the open update's target (serving + 1), in mode "keep"
        when an operator paused with keep (/pause?mode=keep) else "wait"; answers once it is committed (every
        engine received every byte and serves it). Names that do not cover the model make it a partial push
        (the rest keep their values), as vLLM loads whatever it is sent. A refused push closes the group: the
        trainer started broadcasting with the request (vLLM's protocol), so the group is out of step."""
        if not isinstance(info, dict):
            raise DialectError(400, "update_info: must be an object {names, dtype_names, shapes}", "update_info")
        _unknown(info, UPDATE_FIELDS, "update_info")
        f = Fields(info, "update_info.")
        for key in ("packed", "is_checkpoint_format"):
            if not f.bool(key, True):
                raise DialectError(400, f"update_info.{key}: must be true", f"update_info.{key}")
        group = self.transfer.group
        buffer_bytes = f.int("packed_buffer_size_bytes")
        if buffer_bytes is not None and group is not None and buffer_bytes != group.buffer_bytes:
            raise DialectError(400, f"update_info.packed_buffer_size_bytes: {buffer_bytes} is not the group's chunk "
                                    f"size ({group.buffer_bytes}, set by /init_weight_transfer_engine); both sides "
                                    "must cut the same chunks", "update_info.packed_buffer_size_bytes")
        if f.int("packed_num_buffers", 1) < 1:
            raise DialectError(400, "update_info.packed_num_buffers: must be >= 1", "update_info.packed_num_buffers")
        metas = self._metas(info)
        target = self.open
        if target is None:
            raise DialectError(409, "/update_weights: no weight update is open; POST /start_weight_update first "
                                    "(then /update_weights, then /finish_weight_update)")
        manifest = self.weights.manifests[target]
        partial = bool(set(manifest.tensors) - {m.name for m in metas})
        version = self.pool.versions[target] + 1
        mode = "keep" if self.pool.held == "keep" else "wait"
        out = None
        try:
            async for item in self.transfer.push(version, target, mode, partial, metas, ""):
                out = item
        except ServiceError as e:
            self.pool.telemetry.push_failed("transfer")
            err = from_service_error(e, SPELLING)
            if await self._close_out_of_step():
                err.message += (". The weight-transfer group was closed (the trainer had started broadcasting): "
                                "POST /init_weight_transfer_engine again")
            raise err from None
        self.pool.telemetry.push_committed("transfer", out.target, out.num_bytes, out.total_s, out.pause_s)
        self.committed = out.version
        return {"message": "Weights updated", "target": out.target, "version": out.version,
                "num_tensors": out.num_tensors, "num_bytes": out.num_bytes, "partial": out.partial,
                "total_s": round(out.total_s, 3), "pause_s": round(out.pause_s, 3)}

    def finish(self, body: dict) -> dict:
        """Close the open update. weight_version (vLLM labels versions with strings): an integer must be the
        version this update committed; any other label is accepted and logged (versions here are integers)."""
        label = body.get("weight_version")
        if label is not None and (isinstance(label, bool) or not isinstance(label, (str, int))):
            raise DialectError(400, "weight_version: must be a string", "weight_version")
        if self.open is None:
            raise DialectError(409, "no weight update is open; POST /start_weight_update first")
        target = self.open
        version = self.committed if self.committed is not None else self.pool.versions[target]
        if label is not None:
            try:
                wanted = int(label)
            except ValueError:
                log.info("/finish_weight_update: weight_version %r is not an integer; the %s serves as version %d",
                         label, target, version)
            else:
                if wanted != version:
                    raise DialectError(400, f"weight_version: {label!r} is not the version this update committed "
                                            f"({version}); this service numbers versions itself (the serving one "
                                            "+ 1 per /update_weights)", "weight_version")
        self.open = self.committed = None
        return {"message": "Weight update finished", "target": target, "weight_version": str(version)}

    # ---- helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def _metas(info: dict) -> list[Meta]:
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise DialectError(400, "update_info.names: must be a non-empty list of tensor names", "update_info.names")
        if not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes) or len(dtypes) != len(names):
            raise DialectError(400, f"update_info.dtype_names: must be a list of {len(names)} dtype names (one per "
                                    "name)", "update_info.dtype_names")
        if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
                isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in s)
                for s in shapes):
            raise DialectError(400, f"update_info.shapes: must be a list of {len(names)} shapes (lists of integers, "
                                    "one per name)", "update_info.shapes")
        return [Meta(n, d.removeprefix("torch."), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]

    async def _close_out_of_step(self) -> bool:
        """Close the group after a refused push, unless another transfer holds it. True: this call closed it."""
        if self.transfer.group is None or self.transfer.lock.locked():
            return False
        with contextlib.suppress(ServiceError):
            await self.transfer.close()
            return True
        return False
