"""Weights over a collective group (the `gloo` backend): the wire format both sides share, and the trainer's side.

The group is a torch process group built without touching torch.distributed's global state, exactly as vLLM's
`stateless_init_torch_distributed_process_group` builds it on the engines' side: a TCPStore hosted by trainer
rank 0 at (master_address, master_port), a PrefixStore named by that address, a ProcessGroupGloo. Trainer ranks
are 0..T-1; the engines' workers follow at the rank offsets the service gives (InitWeightTransfer).

A push moves the tensors in vLLM's packed format (vllm/distributed/weight_transfer/packed_tensor.py): each
trainer rank's tensors, in the order of the push's metadata, are concatenated as bytes into chunks; a chunk is
closed after the tensor that takes it past `buffer_bytes`; each chunk is one broadcast from that rank. Both sides
cut the chunks from the same metadata, so only the bytes travel. Rank r's chunks follow rank r-1's.

Needs torch (the `[torch]` extra).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

DEFAULT_BUFFER_BYTES = 64 << 20      # per chunk: large enough to stream at the group's rate, small enough to overlap
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def nbytes(dtype_name: str, shape) -> int:
    return math.prod(shape) * ITEMSIZE[dtype_name]


def chunks(sizes: list[int], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors of each chunk (vLLM's packing rule: a chunk ends with the tensor that takes it
    past buffer_bytes, or with the last tensor)."""
    out, cur, total = [], [], 0
    for i, size in enumerate(sizes):
        cur.append(i)
        total += size
        if total > buffer_bytes:
            out.append(cur)
            cur, total = [], 0
    if cur:
        out.append(cur)
    return out


def gloo_group(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float, store=None):
    """Join (rank 0: host) the group's TCPStore and build its gloo process group, as vLLM's workers do.
    Returns (process group, store). Raises (after timeout_s) when not every rank joins."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    host = f"[{master_address}]" if ":" in master_address else master_address
    init = f"tcp://{host}:{master_port}"
    store = store or open_store(master_address, master_port, rank == 0, timeout_s)
    return ProcessGroupGloo(PrefixStore(init, store), rank, world_size, timedelta(seconds=timeout_s)), store


def open_store(master_address: str, master_port: int, host: bool, timeout_s: float):
    """The group's TCPStore: hosted by trainer rank 0 (it does not wait for the others to connect, so it can
    publish the group's shape to its own ranks first), a client everywhere else."""
    from torch.distributed import TCPStore

    return TCPStore(master_address, master_port, is_master=host, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s))


def _buffer(pool: list | None, slot: int, size: int):
    """A uint8 buffer of `size` bytes, kept in `pool` between pushes: a fresh one costs a page fault per 4 KiB
    (0.1-0.2 s per 269 MB here), a kept one nothing."""
    import torch

    if pool is None:
        return torch.empty(size, dtype=torch.uint8)
    while len(pool) <= slot:
        pool.append(torch.empty(0, dtype=torch.uint8))
    if pool[slot].numel() < size:
        pool[slot] = torch.empty(size, dtype=torch.uint8)
    return pool[slot][:size]


def send(pg, tensors: list, src: int, buffer_bytes: int, buffers: list | None = None) -> int:
    """Broadcast `tensors` (this rank's part, CPU, in metadata order) from rank `src`; returns the bytes sent.
    The next chunk is packed while the previous one is on the wire (two buffers: chunk n-2's broadcast has
    ended before chunk n is packed into its buffer). buffers: a list kept between calls."""
    import torch

    sizes = [t.numel() * t.element_size() for t in tensors]
    pending, sent = None, 0
    for n, idx in enumerate(chunks(sizes, buffer_bytes)):
        buf = _buffer(buffers, n % 2, sum(sizes[i] for i in idx))
        torch.cat([tensors[i].detach().contiguous().reshape(-1).view(torch.uint8) for i in idx], out=buf)
        if pending is not None:
            pending.wait()
        pending = pg.broadcast(buf, src)
        sent += buf.numel()
    if pending is not None:
        pending.wait()
    return sent


def receive(pg, metas: list[tuple[str, str, list[int]]], src: int, buffer_bytes: int,
            consume: Callable[[list[tuple[str, object]]], None], buffers: list | None = None) -> int:
    """Receive the tensors `metas` [(name, dtype name, shape)] broadcast from rank `src`, handing each chunk's
    (name, tensor) views to `consume` while the next chunk arrives. Returns the bytes received.

    buffers: a list kept between calls, two buffers reused chunk after chunk: the views are valid only during
    `consume`. None: a fresh buffer per chunk, so a view stays valid as long as the consumer keeps it. vLLM's
    layerwise reload (`load_weights` during a weight update) keeps each tensor it is given until every weight of
    that layer has arrived, which may be chunks later: it needs None (with reused buffers the next chunks
    overwrote a split layer's first part, and the engine served weights that were neither version)."""
    import torch

    sizes = [nbytes(d, s) for _, d, s in metas]
    plan = chunks(sizes, buffer_bytes)
    if not plan:
        return 0

    def post(n: int):
        buf = _buffer(buffers, n % 2, sum(sizes[i] for i in plan[n]))
        return buf, pg.broadcast(buf, src)

    pending = [post(0)]
    got = 0
    for n, idx in enumerate(plan):
        cur, work = pending.pop(0)
        work.wait()
        if n + 1 < len(plan):                  # the next chunk lands in another buffer while this one is used
            pending.append(post(n + 1))
        out, off = [], 0
        for i in idx:
            name, dtype, shape = metas[i]
            piece = cur[off:off + sizes[i]]
            itemsize = ITEMSIZE[dtype]
            if (piece.storage_offset() % itemsize) != 0:
                piece = piece.clone()          # an unaligned start (after an odd-sized bf16 tensor)
            out.append((name, piece.view(getattr(torch, dtype)).view(shape)))
            off += sizes[i]
        del cur
        consume(out)
        got += off
    return got


def by_rank(metas: list[tuple[str, str, list[int]]], ranks: list[int] | None,
            trainer_ranks: int) -> Iterator[tuple[int, list[tuple[str, str, list[int]]]]]:
    """(src rank, its metas in order) for every trainer rank that sends something."""
    ranks = ranks or [0] * len(metas)
    for r in range(trainer_ranks):
        mine = [m for m, owner in zip(metas, ranks) if owner == r]
        if mine:
            yield r, mine


def tensors_of(weights, dtype=None) -> list[tuple[str, object]]:
    """weights.state_tensors (shared storage once), on the CPU (gloo sends from there) and cast to `dtype` if given."""
    from rollout_client.weights import state_tensors

    return [(name, t.to("cpu", dtype or t.dtype)) for name, t in state_tensors(weights)]


def metas_of(pairs: Iterable[tuple[str, object]]) -> list[tuple[str, str, list[int]]]:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in pairs]


class WeightSync:
    """Weights to the service over a collective group (InitWeightTransfer / TransferWeights): the fast path for a
    trainer that pushes every step. Every trainer rank makes the same calls; each sends the tensors it holds.

        sync = WeightSync(client, master_address="10.0.0.5")   # the address engines reach this trainer at
        sync.connect()                                         # once: the group forms (rank 0 hosts it)
        result = sync.push(model, version=step, mode="keep")   # every step: the new version serves on return
        sync.push_adapter("alice", peft_model, version=step)   # a LoRA adapter: only its tensors move

    Sharded trainers: WeightSync(client if rank == 0 else None, rank=r, ranks=R, master_port=P) on every rank (P
    chosen by the launcher, the same everywhere); push(part) with each rank's own tensors (no name twice). Rank 0
    drives the RPCs; the ranks meet in the group's store. Backend gloo (this package); on GPU nodes with the
    service's engines on `nccl`, use vLLM's trainer-side engine (docs/deployment.md).
    """

    def __init__(self, client=None, *, master_address: str = "127.0.0.1", master_port: int = 0, rank: int = 0,
                 ranks: int = 1, timeout_s: float = 0.0, backend: str = "auto"):
        if rank == 0 and client is None:
            raise ValueError("rank 0 needs a RolloutClient (it drives the RPCs)")
        if rank and not master_port:
            raise ValueError("ranks > 0 need master_port (the port rank 0 hosts the group at)")
        self.client, self.rank, self.ranks = client, rank, ranks
        self.address, self.port, self.timeout_s, self.backend = master_address, master_port, timeout_s, backend
        self.group = None            # rank 0: the service's WeightTransferGroup
        self.pg = self.store = None
        self.world_size = 0
        self.buffer_bytes = DEFAULT_BUFFER_BYTES
        self._pushes = 0
        self._buffers: list = []       # packing buffers kept between pushes

    def connect(self, timeout: float | None = None) -> None:
        """Set up the group: rank 0 asks the service (its engines start joining) and hosts the rendezvous; other
        ranks join it. Returns once every rank joined."""
        from rollout_client.api import pb

        if self.rank == 0:
            if not self.port:
                self.port = _free_port(self.address)
            stream = self.client.stub.InitWeightTransfer(pb.WeightTransferInit(
                backend=self.backend, master_address=self.address, master_port=self.port, trainer_ranks=self.ranks,
                timeout_s=self.timeout_s), timeout=timeout, metadata=self.client.auth.admin())
            shape = next(stream)
            if shape.backend != "gloo":
                stream.cancel()
                raise RuntimeError(f"the service's engines use {shape.backend!r}: use vLLM's trainer-side engine "
                                   "for it")
            self.world_size, self.buffer_bytes = shape.world_size, shape.buffer_bytes or DEFAULT_BUFFER_BYTES
            wait = shape.timeout_s or 120.0
            store = open_store(self.address, self.port, True, wait)      # first: the other ranks read the shape
            store.set("rollout/world_size", str(self.world_size))
            store.set("rollout/buffer_bytes", str(self.buffer_bytes))
            self.pg, self.store = gloo_group(self.address, self.port, 0, self.world_size, wait, store=store)
            self.group = next(stream)          # every engine joined
        else:
            wait = self.timeout_s or 120.0
            store = open_store(self.address, self.port, False, wait)
            self.world_size = int(store.get("rollout/world_size"))
            self.buffer_bytes = int(store.get("rollout/buffer_bytes"))
            self.pg, self.store = gloo_group(self.address, self.port, self.rank, self.world_size, wait, store=store)

    def push(self, weights, version: int, *, target: str = "policy", mode: str = "wait", partial: bool = False,
             dtype=None, timeout: float | None = None):
        """Send this rank's tensors (an nn.Module or a name->tensor dict) as `version` of `target`. Rank 0 returns
        the PushResult once the new version serves (the others None). Raises with the service's reason when it
        refuses the push (nothing is sent then) or the commit fails (the previous version keeps serving)."""
        return self._push(tensors_of(weights, dtype), version, target=target, mode=mode, partial=partial,
                          timeout=timeout)

    def push_adapter(self, name: str, adapter, version: int, *, config=None, dtype=None,
                     timeout: float | None = None):
        """Send a LoRA adapter as version `version` of policy `name` over the group (RolloutClient.push_adapter's
        fast path): a PEFT model (only its adapter's tensors and config), or a PEFT-named tensor dict with `config`
        (PEFT's adapter_config as a dict or JSON text; rank 0's is the one sent). Sharded: each rank its own part
        (a dict, possibly empty). Committed on every engine or on none, as a push."""
        from rollout_client.client import adapter_payload

        if hasattr(adapter, "peft_config") or config is not None:
            tensors, text = adapter_payload(adapter, config)
        else:
            tensors, text = dict(adapter), ""
        pairs = [(n, t.detach().to("cpu", dtype or t.dtype)) for n, t in tensors.items()]
        return self._push(pairs, version, target="adapter", timeout=timeout, adapter=name, adapter_config=text)

    def _push(self, pairs, version: int, *, target: str, mode: str = "wait", partial: bool = False,
              timeout: float | None = None, adapter: str = "", adapter_config: str = ""):
        import json

        from rollout_client.api import pb
        from rollout_client.types import PushResult
        from rollout_client.wire import MODES, TARGETS

        if self.pg is None:
            raise RuntimeError("connect() first (again after a failed push: the service closed the group)")
        mine = metas_of(pairs)
        key = f"rollout/push/{self._pushes}"
        self._pushes += 1
        self.store.set(f"{key}/metas/{self.rank}", json.dumps(mine))
        parts = [json.loads(self.store.get(f"{key}/metas/{r}")) for r in range(self.ranks)]
        call = None
        if self.rank == 0:
            tensors = [pb.TensorMeta(name=n, dtype=d, shape=s, src_rank=r)
                       for r, part in enumerate(parts) for n, d, s in part]
            call = self.client.stub.TransferWeights(pb.TransferRequest(
                version=version, target=TARGETS[target], in_flight=MODES[mode], partial=partial, tensors=tensors,
                group_id=self.group.group_id, adapter=adapter, adapter_config=adapter_config), timeout=timeout,
                metadata=self.client.auth.admin())
            try:
                first = next(call)
            except Exception as e:
                why = e.details() if hasattr(e, "details") else str(e)
                self.store.set(f"{key}/ready", f"refused the push: {why}")
                raise
            self.store.set(f"{key}/ready", "ok")
            assert first.WhichOneof("item") == "ready"
        ready = self.store.get(f"{key}/ready").decode()
        if ready != "ok":
            raise RuntimeError(f"the service {ready}")
        for r, part in enumerate(parts):          # every rank takes part in every rank's broadcasts
            if r == self.rank:
                send(self.pg, [t for _, t in pairs], r, self.buffer_bytes, self._buffers)
            elif part:
                receive(self.pg, [tuple(m) for m in part], r, self.buffer_bytes, lambda _items: None, self._buffers)
        if call is None:
            return None
        try:
            return PushResult.from_proto(next(call).result)
        except Exception:
            # the service closed the group (a collective cannot resume half-way): so does this side
            self._drop_group()
            raise

    def _drop_group(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:  # noqa: BLE001 - a broken group still goes
                pass
        self.pg = self.store = self.group = None

    def close(self) -> None:
        """Tear the group down (rank 0 asks the service to leave it first)."""
        from rollout_client.api import pb

        if self.rank == 0 and self.client is not None and self.group is not None:
            self.client.stub.CloseWeightTransfer(pb.CloseWeightTransferRequest(), metadata=self.client.auth.admin())
        self._drop_group()


def _free_port(address: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
