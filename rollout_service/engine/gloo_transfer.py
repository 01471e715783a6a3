"""The `gloo` weight-transfer backend: vLLM's weight-transfer engine interface over a gloo process group, so that
the CPU runs the same orchestration as `nccl` does on GPU nodes (init the group, start, receive, finish).

Registered with vLLM's WeightTransferEngineFactory by `register()` (worker_ext imports this module in every
worker). The rendezvous has `nccl`'s shape (master_address, master_port, rank_offset, world_size; the trainer's
rank 0 hosts the TCPStore) and the group is vLLM's own stateless gloo group
(vllm.distributed.utils.stateless_init_torch_distributed_process_group). The bytes move in vLLM's packed format
(rollout_client/transfer.py, shared with the trainer's side), from each trainer rank in turn.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

log = logging.getLogger(__name__)
BACKEND = "gloo"
LISTEN_POLL_S = 0.2           # how often a join looks for the trainer's rendezvous until it listens
MIN_STEP_S = 0.5              # the least a join step is given once the rendezvous listens


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int                  # this engine's first worker rank in the group (trainer ranks come first)
    world_size: int
    trainer_ranks: int = 1
    packed_buffer_size_bytes: int = 1 << 30     # vLLM's default (packed_tensor.py), as its nccl engine: an init
                                                # without it (TRL's) cuts where the trainer's packer does
    timeout_s: float = 120.0          # rendezvous, and each broadcast: a rank that is gone fails the push then
    packed: bool = True               # accepted for nccl-shaped payloads; gloo always packs


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    src_ranks: list[int] = field(default_factory=list)   # the trainer rank sending each tensor (empty: all rank 0)
    is_checkpoint_format: bool = True

    def __post_init__(self):
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n or (self.src_ranks and len(self.src_ranks) != n):
            raise ValueError(f"update_info: names ({n}), dtype_names ({len(self.dtype_names)}), shapes "
                             f"({len(self.shapes)}) and src_ranks ({len(self.src_ranks)}) must have one entry per "
                             "tensor")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.info: GlooInitInfo | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the group, within init_info.timeout_s in all (then TimeoutError): torch's own steps each wait the
        whole timeout (the store's connect, then gloo's rendezvous), so a join nobody completes would end at two
        or more timeouts. Each step here gets what is left of one."""
        import torch
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.shutdown()
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        timeout_s = init_info.timeout_s
        deadline = time.monotonic() + timeout_s
        wait_for_listener(init_info.master_address, init_info.master_port, deadline, timeout_s)
        left = timedelta(seconds=max(deadline - time.monotonic(), MIN_STEP_S))
        group, store = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, backend="gloo",
            timeout=left, return_store=True)
        full = timedelta(seconds=timeout_s)         # each broadcast of a push waits the whole timeout
        store.set_timeout(full)
        group._get_backend(torch.device("cpu"))._set_default_timeout(full)
        self.group = group
        self.info = init_info
        log.info("joined the gloo weight-transfer group at %s:%d as rank %d of %d", init_info.master_address,
                 init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))   # CPU: nothing to synchronize

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from rollout_client.transfer import by_rank, receive

        if self.group is None or self.info is None:
            raise RuntimeError("gloo weight transfer is not initialized; call init_weight_transfer_engine first")
        metas = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        for src, mine in by_rank(metas, update_info.src_ranks, self.info.trainer_ranks):
            # a fresh buffer per chunk (buffers=None): the layerwise reload keeps a layer's tensors until all of
            # them arrived, possibly chunks later, so no buffer may be reused within a push
            receive(self.group, mine, src, self.info.packed_buffer_size_bytes, self.model.load_weights)

    def shutdown(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception:
                log.warning("shutting the gloo weight-transfer group down failed", exc_info=True)
            self.group = None


def wait_for_listener(host: str, port: int, deadline: float, timeout_s: float) -> None:
    """Return once something listens at host:port (the trainer's rank 0 hosts the group's store there); raise
    TimeoutError at `deadline`."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing listened at {host}:{port} within {timeout_s:g} s (the trainer's rank 0 "
                               "hosts the group's rendezvous there)")
        try:
            socket.create_connection((host, port), timeout=min(left, 2.0)).close()
            return
        except OSError:
            time.sleep(min(LISTEN_POLL_S, max(deadline - time.monotonic(), 0)))


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
