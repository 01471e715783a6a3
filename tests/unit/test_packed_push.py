"""Pushes whose small tensors travel several to a gRPC message (PushRequest.batch, a TensorBatch), through a real
in-process gRPC server (the servicer, its request parsing and limits) over FakeEngines: packed, unpacked and mixed
streams commit the same bytes; every check of a TensorChunk message holds for each entry of a batch, with the same
errors naming the tensor, and a refused or cut push leaves what was served."""
import asyncio
import inspect
import json

import grpc
import pytest
import torch
from rollout_client.client import AsyncRolloutClient
from rollout_client.weights import push_stream

from rollout_service.api import pb, pb_grpc
from rollout_service.model_info import ModelInfo
from rollout_service.scratch import SPARE_NAME, scratch_root
from rollout_service.server.decoding import add_servicer
from rollout_service.server.grpc_service import RolloutServicer
from rollout_service.validation import Limits
from tests.unit.test_adapters import BASE, CONFIG, adapter, make, write_base

ADAPTER_CONFIG = json.dumps(CONFIG)


@pytest.fixture
def ckpt(tmp_path):
    return write_base(tmp_path / "base")


class Served:
    """A gRPC server on a free local port: RolloutServicer over a pool of FakeEngines with LoRA on."""

    def __init__(self, pool, weights, server, target):
        self.pool, self.weights, self.server, self.target = pool, weights, server, target
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.RolloutServiceStub(self.channel)

    async def push(self, messages, timeout=None):
        return await self.stub.PushWeights(iter(messages), timeout=timeout)

    async def error_of(self, messages, timeout=None) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await self.push(messages, timeout)
        return e.value

    def adapter_file(self, name: str) -> bytes:
        a = self.pool.adapters.adapters[name]
        return (a.versions[a.latest].path / "adapter_model.safetensors").read_bytes()

    def served(self) -> tuple:
        """What the pool serves: each adapter's latest and loaded versions, each engine's adapters and weights."""
        return ({n: (a.latest, sorted(a.versions)) for n, a in self.pool.adapters.adapters.items()},
                [dict(e.adapters) for e in self.pool.engines],
                [{k: v.clone() for k, v in e.weights.items()} for e in self.pool.engines],
                self.pool.policy_version)

    async def close(self):
        await self.channel.close()
        await self.server.stop(None)


async def serve(ckpt, max_message_bytes=0) -> Served:
    pool, weights, _ = await make(ckpt, max_adapters=4)
    model = ModelInfo(path=str(ckpt), vocab_size=50, max_model_len=256, tokenizer=None)
    server = grpc.aio.server()
    add_servicer(RolloutServicer(pool, model, Limits(8, 8), weights), server, max_message_bytes=max_message_bytes)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return Served(pool, weights, server, f"127.0.0.1:{port}")


def run(test):
    """The test body gets a Served (in place of the ckpt fixture) and runs in its own event loop (the unit suite has
    no asyncio plugin); its other parameters are pytest's as usual."""
    def wrapper(ckpt, **kwargs):
        async def main():
            s = await serve(ckpt)
            try:
                await test(s, **kwargs)
            finally:
                await s.close()
        asyncio.run(main())
    params = list(inspect.signature(test).parameters.values())[1:]
    wrapper.__signature__ = inspect.Signature([inspect.Parameter("ckpt", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                               *params])
    wrapper.__name__, wrapper.__doc__ = test.__name__, test.__doc__
    return wrapper


def adapter_stream(name, version, tensors=None, **kw):
    return list(push_stream(tensors if tensors is not None else adapter(seed=version), version,
                            target=pb.TARGET_ADAPTER, adapter=name, adapter_config=ADAPTER_CONFIG, **kw))


def kinds(messages) -> list[str]:
    return [m.WhichOneof("item") for m in messages]


def regroup(messages, per_batch: int):
    """The same chunks, in the same order, packed `per_batch` to a TensorBatch (across tensor boundaries)."""
    chunks = [m.chunk for m in messages if m.WhichOneof("item") == "chunk"]
    out = [messages[0]]
    for i in range(0, len(chunks), per_batch):
        out.append(pb.PushRequest(batch=pb.TensorBatch(chunks=chunks[i:i + per_batch])))
    return out + [m for m in messages if m.WhichOneof("item") == "trailer"]


def staging_files() -> set[str]:
    folder = scratch_root() / "adapter-staging"
    return {p.name for p in folder.iterdir() if p.name != SPARE_NAME} if folder.is_dir() else set()


# ---- the same commit, packed or not ------------------------------------------------------------------------------
@run
async def test_packed_unpacked_and_mixed_adapter_streams_commit_the_same_file(s):
    tensors = adapter(seed=7)
    unpacked = adapter_stream("a", 1, tensors, pack_bytes=0, chunk_bytes=64)
    packed = adapter_stream("b", 1, tensors)
    # pieces of the bigger tensors (64 bytes each) and whole small ones, three to a batch, across tensor boundaries
    mixed = regroup(adapter_stream("c", 1, tensors, pack_bytes=0, chunk_bytes=64), 3)
    mixed[0].header.adapter = "c"
    hashed_first = adapter_stream("d", 1, tensors, checksum="header")        # the sha256 in the header
    assert kinds(hashed_first) == ["header", "batch"] and hashed_first[0].header.sha256
    assert kinds(unpacked) == ["header"] + ["chunk"] * (len(unpacked) - 2) + ["trailer"] and len(unpacked) > 8
    assert kinds(packed) == ["header", "batch", "trailer"] and len(packed[1].batch.chunks) == 6
    assert kinds(mixed)[1:-1] == ["batch"] * (len(mixed) - 2)
    results = [await s.push(m) for m in (unpacked, packed, mixed, hashed_first)]
    assert {(r.num_tensors, r.num_bytes, r.version) for r in results} == {(6, sum(t.numel() * 4 for t in
                                                                               tensors.values()), 1)}
    files = [s.adapter_file(n) for n in "abcd"]
    assert files[0] == files[1] == files[2] == files[3]
    assert all(len(e.adapters) == 4 for e in s.pool.engines)


@run
async def test_packed_and_unpacked_policy_pushes_serve_the_same_weights(s):
    """A full push of the base (every tensor smaller than 1 MiB: one batch) serves what the unpacked one served."""
    w1 = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in BASE.items()}
    w2 = {k: v + 1 for k, v in w1.items()}
    plain = list(push_stream(w1, 1, target=pb.TARGET_POLICY, pack_bytes=0))
    assert kinds(plain).count("chunk") == len(BASE)
    r1 = await s.push(plain)
    served = s.served()[2]
    await s.push(list(push_stream(w2, 2, target=pb.TARGET_POLICY)))          # something else in between
    packed = list(push_stream(w1, 3, target=pb.TARGET_POLICY))
    assert kinds(packed) == ["header", "batch", "trailer"]
    r3 = await s.push(packed)
    assert (r3.num_tensors, r3.num_bytes) == (r1.num_tensors, r1.num_bytes) and s.pool.policy_version == 3
    for before, now in zip(served, s.served()[2]):
        assert before.keys() == now.keys() and all(torch.equal(before[k], now[k]) for k in before)


@run
async def test_the_bundled_client_packs_and_can_send_one_tensor_per_message(s):
    c = AsyncRolloutClient(s.target)
    real, sent = c.stub.PushWeights, []

    def spy(stream, **kw):                   # what the client sends, then sent on
        messages = list(stream)
        sent.append(kinds(messages))
        return real(iter(messages), **kw)
    c.stub.PushWeights = spy
    try:
        tensors = adapter(seed=3)
        await c.push_adapter("a", tensors, 1, config=CONFIG)
        await c.push_adapter("b", tensors, 1, config=CONFIG, pack_bytes=0)
        await c.push_weights(BASE, 1)
    finally:
        await c.close()
    assert sent == [["header", "batch", "trailer"], ["header"] + ["chunk"] * 6 + ["trailer"],
                    ["header", "batch", "trailer"]]
    assert s.adapter_file("a") == s.adapter_file("b")


# ---- malformed batches: INVALID_ARGUMENT naming what is wrong, nothing changed -------------------------------------
def _bad(how: str, messages):
    header, batch, trailer = messages
    entries = batch.batch.chunks
    if how == "empty batch":
        return [header, pb.PushRequest(batch=pb.TensorBatch()), batch, trailer]
    if how == "unknown tensor":
        entries[2].name = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    elif how == "shape":
        entries[2].shape[:] = [3, 3]
    elif how == "dtype":
        entries[2].dtype = "float16"
    elif how == "twice":
        entries.add().CopyFrom(entries[2])
        header.header.total_bytes += len(entries[2].data)
    elif how == "past the end":
        entries[2].offset = 8
    elif how == "more bytes than the header says":
        header.header.total_bytes -= 4
    elif how == "data changed":
        entries[2].data = bytes(len(entries[2].data))
    elif how == "batch first":
        return [batch, header, trailer]
    elif how == "batch after the trailer":
        return [header, trailer, batch]
    elif how == "batch cut short":
        del entries[-1]
    return [header, batch, trailer]


BAD = {"empty batch": "batch with no chunks",
       "unknown tensor": "o_proj.lora_A.weight' is not a parameter",
       "shape": "lora_A.weight': shape [3, 3] does not match",
       "dtype": "lora_A.weight': dtype 'float16' not accepted",
       "twice": "lora_A.weight': chunk [0, ",          # ... overlaps bytes already received
       "past the end": "runs past the tensor's",
       "more bytes than the header says": "more tensor data arrived",
       "data changed": "sha256 mismatch",
       "batch first": "first message must carry the header",
       "batch after the trailer": "trailer must be the last message",
       "batch cut short": "cut short"}


@pytest.mark.parametrize("how", list(BAD))
@run
async def test_a_malformed_batch_is_refused_naming_it_and_nothing_changes(s, how):
    await s.push(adapter_stream("a", 1))
    before, files = s.served(), staging_files()
    messages = _bad(how, adapter_stream("a", 2))
    e = await s.error_of(messages)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and BAD[how] in e.details(), e.details()
    if how in ("unknown tensor", "shape", "dtype", "twice"):
        assert "tensor 'base_model.model.model.layers.0." in e.details()
    now = s.served()
    assert now[:2] == before[:2] and now[3] == before[3]
    assert staging_files() == files                    # the staging file was given up
    assert (await s.push(adapter_stream("a", 2))).version == 2       # and nothing is stuck


@run
async def test_a_batch_above_max_message_mb_is_refused_and_one_tensor_per_message_passes(s):
    messages = adapter_stream("a", 1)
    size = max(len(m.SerializeToString()) for m in messages)
    assert kinds(messages) == ["header", "batch", "trailer"] and size > 600
    s2 = await serve(s.pool.committed.checkpoints["policy"], max_message_bytes=600)
    try:
        e = await s2.error_of(messages)
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_mb" in e.details(), e.details()
        assert "a" not in s2.pool.adapters.adapters
        assert (await s2.push(adapter_stream("a", 1, pack_bytes=200))).version == 1     # smaller batches
    finally:
        await s2.close()


# ---- cut streams ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", ["cancelled", "deadline"])
@run
async def test_a_packed_push_cut_mid_stream_leaves_the_previous_version(s, cut):
    await s.push(adapter_stream("a", 1))
    before, files = s.served(), staging_files()
    messages = adapter_stream("a", 2, pack_bytes=200)
    assert kinds(messages)[:3] == ["header", "batch", "batch"]
    sent = asyncio.Event()

    async def stalled():
        yield messages[0]
        yield messages[1]                    # one batch, then the trainer hangs
        sent.set()
        await asyncio.sleep(3600)
        yield messages[2]

    call = s.stub.PushWeights(stalled(), timeout=1.0 if cut == "deadline" else None)
    await sent.wait()
    await asyncio.sleep(0.3)                  # the server has the batch
    if cut == "cancelled":
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    else:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):                      # the server's cleanup runs once it sees the cut
        if staging_files() == files:
            break
        await asyncio.sleep(0.05)
    assert staging_files() == files
    now = s.served()
    assert now[:2] == before[:2] and now[3] == before[3]
    assert (await s.push(adapter_stream("a", 2))).version == 2


# ---- fixed costs ----------------------------------------------------------------------------------------------
@run
async def test_an_unloaded_versions_file_is_the_next_adapter_pushs_staging_file(s, monkeypatch):
    """An adapter push stages into the weights file of a version unloaded earlier (its pages allocated), not a fresh
    file; the versions served are what was pushed."""
    from rollout_service.weights import service as weight_service

    stagers = []

    class Spy(weight_service.Stager):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            stagers.append(self)
    monkeypatch.setattr(weight_service, "Stager", Spy)
    pushed = {v: adapter(seed=v) for v in (1, 2, 3, 4)}
    for v in (1, 2, 3):                           # versions_kept 2: the third push unloads version 1
        await s.push(adapter_stream("a", v, pushed[v]))
    assert sorted(s.pool.adapters.adapters["a"].versions) == [2, 3]
    spare = scratch_root() / "adapter-staging" / SPARE_NAME
    assert spare.is_file() and spare.stat().st_blocks > 0
    await s.push(adapter_stream("a", 4, pushed[4]))
    assert stagers[-1].recycled_bytes > 0         # version 1's file, its pages allocated
    from safetensors.torch import load_file
    for v in (3, 4):
        served = load_file(str(s.pool.adapters.adapters["a"].versions[v].path / "adapter_model.safetensors"))
        assert served.keys() == pushed[v].keys() and all(torch.equal(served[k], pushed[v][k]) for k in served)
