"""Delta pushes (weights/delta.py) through the real WeightService and committer on FakeEngines: a delta serves exactly
what a full push of the same state serves (values and fingerprint), a delta against another base or a malformed one
changes nothing, LoadWeights takes a delta file, and a server killed at any phase of a delta's commit restarts at the
old or the new version."""
import asyncio

import grpc
import numpy as np
import pytest
import torch

from rollout_client.delta import Change, _bits, delta_stream, diff, fingerprint, save_delta
from rollout_client.weights import push_stream
from rollout_service.api import pb
from rollout_service.errors import ServiceError
from rollout_service.faults import COMMIT_POINTS
from rollout_service.pool.pool import EnginePool
from rollout_service.server.convert import status_to_proto
from rollout_service.weights.service import Chunk, Header, Trailer, WeightService
from tests.fake_engine import FakeEngine
from tests.unit.conftest import push, push_then_crash, run_until_killed, write_checkpoint

BASE = {"a.weight": torch.linspace(-1, 1, 4000).reshape(40, 100), "b.bias": torch.ones(5, dtype=torch.bfloat16),
        "c.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


@pytest.fixture
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", BASE)


async def _server(ckpt, state_dir="", roots=()):
    pool = EnginePool([FakeEngine(f"e{i}") for i in range(2)], max_queue=10, checkpoints={"policy": ckpt},
                      state_dir=state_dir)
    await pool.start()
    return pool, WeightService.create(pool, "float32", weights_roots=[str(ckpt), *roots])


def _served(pool):
    values = [{n: e.weights.get(n, BASE[n]) for n in BASE} for e in pool.engines]
    for v in values[1:]:
        assert all(torch.equal(v[n], values[0][n]) for n in BASE), "engines serve different values"
    return values[0]


def changes_between(old: dict, new: dict) -> list[Change]:
    """What WeightDeltas sends: each changed tensor sparse, or dense where that is smaller."""
    out = []
    for name, t in new.items():
        idx = diff(_bits(old[name]), _bits(t))
        if idx.size == 0:
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        if idx.size * (4 + t.element_size()) >= t.numel() * t.element_size():
            out.append(Change(name, dtype, list(t.shape), _bits(t).copy()))
        else:
            out.append(Change(name, dtype, list(t.shape), _bits(t)[idx], idx))
    return out


async def push_delta(svc, changes, version, base_version, chunk_bytes=64, tamper=None, target="policy"):
    msgs = list(delta_stream(changes, version, base_version, target=pb.TARGET_POLICY, chunk_bytes=chunk_bytes,
                             pack_bytes=0))
    if tamper:
        tamper(msgs)
    h = msgs[0].header
    header = Header(h.version, target, h.total_bytes, h.sha256, "wait", h.partial, base_version=h.base_version)
    return await svc.push(header, _items(msgs))


async def _items(msgs):
    """A push stream's messages after the header, as WeightService.push takes them (one TensorChunk a message)."""
    for m in msgs[1:]:
        if m.WhichOneof("item") == "trailer":
            yield Trailer(m.trailer.sha256)
        else:
            c = m.chunk
            yield Chunk(c.name, c.dtype, tuple(c.shape), c.offset, c.data, c.indices)


def step(state: dict, seed: int, fraction: float = 0.01) -> dict:
    """A new state: `fraction` of each tensor's elements moved (an optimizer step below most elements' rounding)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in state.items():
        flat = t.clone().reshape(-1)
        pick = torch.rand(flat.numel(), generator=g) < fraction
        flat[pick] = flat[pick] + 0.5
        out[n] = flat.reshape(t.shape)
    return out


def test_deltas_serve_what_a_full_push_of_the_same_state_serves(ckpt, tmp_path):
    async def main():
        pool, svc = await _server(ckpt)
        v1 = step(BASE, 1, 0.5)
        await push(svc, v1, 1)
        state = v1
        for version in (2, 3, 4):
            new = step(state, version)
            new["c.weight"] = state["c.weight"] * 2              # every element: sent dense
            out = await push_delta(svc, changes_between(state, new), version, version - 1)
            state = new
            assert out.version == version and out.base_version == version - 1
            assert all(torch.equal(_served(pool)[n], state[n]) for n in BASE)
            assert out.fingerprint == fingerprint(state) == pool.committed.known_content_fingerprint("policy")
            assert 0 < out.num_bytes < sum(t.numel() * t.element_size() for t in state.values())
        assert status_to_proto(pool, "m", 10, 10).policy_fingerprint == out.fingerprint
        full_pool, full = await _server(ckpt)
        res = await push(full, state, 1)
        assert res.fingerprint == out.fingerprint              # bit-identical to a full push of the same state
        assert all(torch.equal(_served(full_pool)[n], _served(pool)[n]) for n in BASE)
    asyncio.run(main())


def test_the_fingerprint_of_the_checkpoint_is_its_tensors(ckpt):
    async def main():
        pool, _ = await _server(ckpt)
        assert pool.committed.known_content_fingerprint("policy") == ""          # not computed yet
        assert await asyncio.to_thread(pool.committed.content_fingerprint, "policy") == fingerprint(BASE)
        assert status_to_proto(pool, "m", 10, 10).policy_fingerprint == fingerprint(BASE)
    asyncio.run(main())


def test_a_delta_against_another_base_is_refused_naming_both_versions_and_changes_nothing(ckpt):
    async def main():
        pool, svc = await _server(ckpt)
        await push(svc, BASE, 1)
        await push(svc, BASE, 2)
        new = step(BASE, 7)
        for base in (1, 5):
            with pytest.raises(ServiceError) as e:
                await push_delta(svc, changes_between(BASE, new), 3, base)
            assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert f"header.base_version={base}" in e.value.message and "version 2 is serving" in e.value.message
            assert pool.policy_version == 2 and all(torch.equal(_served(pool)[n], BASE[n]) for n in BASE)
    asyncio.run(main())


def _retag(msgs, **fields):
    for m in msgs[1:]:
        if m.WhichOneof("item") == "chunk":
            for k, v in fields.items():
                setattr(m.chunk, k, v(m.chunk) if callable(v) else v)
            return


def _resum(msgs):
    """Fix total_bytes and sha256 after tampering, so the check under test is the one that fires."""
    import hashlib
    h, total = hashlib.sha256(), 0
    for m in msgs[1:]:
        if m.WhichOneof("item") == "chunk":
            h.update(m.chunk.indices)
            h.update(m.chunk.data)
            total += len(m.chunk.indices) + len(m.chunk.data)
    msgs[0].header.total_bytes = total
    msgs[-1].trailer.sha256 = h.hexdigest()


def _idx(values):
    return np.asarray(values, dtype="<u4").tobytes()


@pytest.mark.parametrize("tamper, needle", [
    (lambda m: _retag(m, indices=_idx([4000]), data=np.zeros(1, np.float32).tobytes()),
     "delta index 4000 is outside its 4000 elements"),
    (lambda m: _retag(m, indices=_idx([5, 3]), data=np.zeros(2, np.float32).tobytes()), "strictly ascending"),
    (lambda m: _retag(m, indices=_idx([1, 2]), data=np.zeros(1, np.float32).tobytes()), "needs 8 bytes"),
    (lambda m: _retag(m, indices=b"\x01\x02\x03"), "not a whole number"),
    (lambda m: _retag(m, offset=3), "offset counts the tensor's earlier indices"),
    (lambda m: _retag(m, name="nope.weight"), "not a parameter of the served model"),
])
def test_a_malformed_delta_is_refused_naming_what_is_wrong_and_changes_nothing(ckpt, tamper, needle):
    async def main():
        pool, svc = await _server(ckpt)
        await push(svc, BASE, 1)
        with pytest.raises(ServiceError) as e:
            await push_delta(svc, changes_between(BASE, step(BASE, 3)), 2, 1,
                             tamper=lambda m: (tamper(m), _resum(m)))
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message, e.value.message
        assert pool.policy_version == 1 and all(torch.equal(_served(pool)[n], BASE[n]) for n in BASE)
    asyncio.run(main())


def test_a_sparse_chunk_in_a_full_push_and_an_empty_delta_are_refused(ckpt):
    async def main():
        pool, svc = await _server(ckpt)
        header = Header(1, "policy", 8, "", "wait", True)

        async def sparse():
            yield Chunk("c.weight", "float32", (2, 3), 0, b"\0" * 4, _idx([1]))
        with pytest.raises(ServiceError, match="sparse chunks are for delta pushes"):
            await svc.push(header, sparse())
        await push(svc, BASE, 1)
        with pytest.raises(ServiceError, match="a delta with no tensor"):
            await push_delta(svc, [], 2, 1)
        assert pool.policy_version == 1
    asyncio.run(main())


def test_load_weights_takes_a_delta_file(ckpt, tmp_path):
    async def main():
        pool, svc = await _server(ckpt, roots=[str(tmp_path)])
        await push(svc, BASE, 1)
        new = step(BASE, 9)
        save_delta(tmp_path / "delta.safetensors", changes_between(BASE, new))
        out = await svc.load(str(tmp_path / "delta.safetensors"), 2, "policy", "wait", False, base_version=1)
        assert out.base_version == 1 and out.fingerprint == fingerprint(new)
        assert all(torch.equal(_served(pool)[n], new[n]) for n in BASE)
        with pytest.raises(ServiceError) as e:
            await svc.load(str(tmp_path / "delta.safetensors"), 3, "policy", "wait", False, base_version=1)
        assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION and "base_version=1" in e.value.message
    asyncio.run(main())


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_a_server_killed_at_any_phase_of_a_delta_commit_restarts_at_the_old_or_the_new_version(ckpt, tmp_path,
                                                                                               point):
    state = tmp_path / "state"
    async def start():
        return (await _server(ckpt, state))[1]
    delta = changes_between(BASE, step(BASE, 11))
    run_until_killed(push_then_crash, (start, lambda svc: push(svc, BASE, 1), lambda svc: push_delta(svc, delta, 2, 1),
                                       point), point)

    async def main():
        pool, svc = await _server(ckpt, state)
        expected = 2 if point == "manifest_written" else 1
        want = step(BASE, 11) if expected == 2 else BASE
        assert pool.policy_version == expected
        assert all(torch.equal(_served(pool)[n], want[n]) for n in BASE), f"a mixture after a kill at {point}"
        assert await asyncio.to_thread(pool.committed.content_fingerprint, "policy") == fingerprint(want)
        if expected == 1:                          # the trainer's delta again, against the version that serves
            await push_delta(svc, changes_between(BASE, step(BASE, 11)), 2, 1)
            assert all(torch.equal(_served(pool)[n], step(BASE, 11)[n]) for n in BASE)
    asyncio.run(main())


def test_a_bf16_delta_over_float32_checkpoint_values_starts_from_their_bf16_cast(ckpt):
    """On a bf16 server, tensors never pushed hold the float32 checkpoint's values: a delta takes them as their bf16
    cast (what the engines serve), then writes its elements."""
    async def main():
        pool = EnginePool([FakeEngine("e0")], max_queue=10, checkpoints={"policy": ckpt})
        await pool.start()
        svc = WeightService.create(pool, "bfloat16", weights_roots=[str(ckpt)])
        base = {n: t.to(torch.bfloat16) for n, t in BASE.items()}
        await push(svc, {"c.weight": base["c.weight"]}, 1, partial=True)      # a.weight: still the checkpoint's
        new = step(base, 13)
        out = await push_delta(svc, changes_between(base, new), 2, 1)
        assert out.fingerprint == fingerprint(new) and all(torch.equal(_served(pool)[n], new[n]) for n in BASE)
    asyncio.run(main())


def test_the_drafter_takes_deltas_on_its_own_version_line(ckpt, tmp_path):
    """UpdateDraft's deltas: against the drafter's version, the policy's untouched."""
    async def main():
        zero = {"d.weight": torch.zeros(10, 10)}
        drafter = write_checkpoint(tmp_path / "drafter", zero)
        pool = EnginePool([FakeEngine("e0")], max_queue=10, checkpoints={"policy": ckpt, "drafter": drafter})
        await pool.start()
        svc = WeightService.create(pool, "float32", weights_roots=[str(ckpt)])
        new = {"d.weight": torch.zeros(10, 10)}
        new["d.weight"][3, 4] = 1.0
        with pytest.raises(ServiceError, match="header.base_version=2, but drafter version 0 is serving"):
            await push_delta(svc, changes_between(zero, new), 1, 2, target="drafter")
        full = list(push_stream(zero, 1, target=pb.TARGET_DRAFTER, pack_bytes=0))
        await svc.push(Header(1, "drafter", full[0].header.total_bytes, "", "wait", False), _items(full))
        out = await push_delta(svc, changes_between(zero, new), 2, 1, target="drafter")
        assert out.target == "drafter" and out.base_version == 1 and out.fingerprint == fingerprint(new)
        assert out.num_bytes == 8                          # one index and one float32 value
        assert pool.versions == {"policy": 0, "drafter": 2}
        assert torch.equal(pool.engines[0].weights["d.weight"], new["d.weight"])
    asyncio.run(main())
