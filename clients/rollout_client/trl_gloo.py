"""TRL's vLLM weight sync on a CPU: its NCCL calls swapped for gloo, everything else of TRL unchanged.

TRL (1.16) pushes a trainer's weights to a vLLM server (`trl vllm-serve`, which is `vllm serve` with vLLM's nccl
weight-transfer engine, or this service's vLLM dialect) through its `VLLMClient`: `init_communicator` POSTs
/init_weight_transfer_engine and meanwhile opens the trainer's end of the group with vLLM's
`nccl_common.trainer_init` (TRL's name: `open_trainer_endpoint`); `update_named_params` POSTs /update_weights and
meanwhile broadcasts the tensors with vLLM's `packed_nccl_broadcast_producer`. Both need CUDA and NCCL.

    use_gloo(module)          replaces exactly those two names in a TRL module (`trl.generation.vllm_client`, the
                              GRPO trainer's; `trl.experimental.async_grpo.weight_transfer`, async GRPO's) with
                              GlooEndpoint (the trainer as rank 0 of a gloo group hosting its TCPStore, as vLLM's
                              trainer_init hosts it) and gloo_producer (vLLM's packed chunks, broadcast over gloo)
    allow_cpu_device(cls)     the GRPO trainer's VLLMClient.init_communicator(device) raises NotImplementedError for
                              a non-CUDA device before it does anything; the wrapped method passes "cuda" as a label
                              instead (without an index TRL sets no device, and the endpoint is gloo's: no CUDA
                              call follows)

The server's side must be gloo too: this service on CPU (engine.weight_transfer `auto`), or vLLM's own server with
rollout_service.engine.gloo_serve. Needs torch; the TRL modules are passed in, not imported here.
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable

from rollout_client.transfer import gloo_group, send

VLLM_PACKED_BUFFER_BYTES = 1 << 30   # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES: an init_info without a size uses it


class GlooEndpoint:
    """What vLLM's `nccl_common.trainer_init(init_info)` returns, over gloo: the trainer as rank 0 of the group,
    hosting its TCPStore at init_info's master_address:master_port. TRL's close_communicator clears `.group.store`
    and `.group.socket` (a PyNcclCommunicator's StatelessProcessGroup); close() shuts the gloo group down."""

    def __init__(self, init_info: dict, timeout_s: float = 120):
        self.buffer_bytes = init_info.get("packed_buffer_size_bytes", VLLM_PACKED_BUFFER_BYTES)
        self.pg, store = gloo_group(init_info["master_address"], init_info["master_port"], 0,
                                    init_info["world_size"], timeout_s=timeout_s)
        self.group = types.SimpleNamespace(store=store, socket=None)
        self.sent: list[int] = []            # bytes of each push

    def close(self) -> None:
        self.pg.shutdown()


def gloo_producer(iterator, group: GlooEndpoint, src: int, post_iter_func, buffer_size_bytes=None,
                  num_buffers: int = 2) -> None:
    """vLLM's packed_nccl_broadcast_producer over gloo: the same packed chunks (rollout_client.transfer.chunks is
    vLLM's pack_tensors rule), cut by the init's buffer size, which the receiving engines cut by too."""
    if buffer_size_bytes is not None and buffer_size_bytes != group.buffer_bytes:
        raise ValueError(f"buffer_size_bytes {buffer_size_bytes} differs from the group's packed_buffer_size_bytes "
                         f"{group.buffer_bytes}: the receivers would cut the chunks elsewhere")
    tensors = [post_iter_func(item).detach().cpu() for item in iterator]
    group.sent.append(send(group.pg, tensors, src, group.buffer_bytes))


def use_gloo(module, set_attr: Callable = setattr) -> list[GlooEndpoint]:
    """Swap `module.open_trainer_endpoint` and `module.packed_nccl_broadcast_producer` (TRL's two NCCL calls) for
    their gloo equivalents. Returns the list the endpoints opened through it go to. set_attr: e.g. pytest's
    monkeypatch.setattr, to undo it."""
    for name in ("open_trainer_endpoint", "packed_nccl_broadcast_producer"):
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name}: not the TRL this was written for (1.16)")
    endpoints: list[GlooEndpoint] = []

    def open_endpoint(init_info: dict) -> GlooEndpoint:
        endpoints.append(GlooEndpoint(init_info))
        return endpoints[-1]
    set_attr(module, "open_trainer_endpoint", open_endpoint)
    set_attr(module, "packed_nccl_broadcast_producer", gloo_producer)
    return endpoints


def allow_cpu_device(client_cls, set_attr: Callable = setattr) -> None:
    """Let `client_cls.init_communicator` (TRL's GRPO VLLMClient) run for a trainer on the CPU: it is called with
    "cuda" as the device, which TRL only checks (and would set as current device if it had an index)."""
    original = client_cls.init_communicator
    if getattr(original, "_gloo_cpu", False):
        return

    @functools.wraps(original)
    def init_communicator(self, device=0):
        return original(self, device="cuda")
    init_communicator._gloo_cpu = True
    set_attr(client_cls, "init_communicator", init_communicator)
