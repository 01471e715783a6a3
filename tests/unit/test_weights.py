"""Staging validation and all-or-nothing commits, on FakeEngine (no vLLM)."""
import asyncio
import hashlib

import grpc
import pytest
import torch
from safetensors.torch import save_file

from rollout_client.weights import push_stream
from rollout_service.api import pb
from rollout_service.engine.fake import FakeEngine
from rollout_service.errors import ServiceError
from rollout_service.pool.pool import EnginePool
from rollout_service.weights.service import Chunk, Header, WeightService

ORIGINAL = {"a.weight": torch.zeros(4, 3), "b.bias": torch.ones(5, dtype=torch.bfloat16)}


@pytest.fixture
def setup(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(ORIGINAL, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text("{}")

    async def make(engines=2):
        pool = EnginePool([FakeEngine(f"e{i}") for i in range(engines)], max_queue=10)
        await pool.start()
        return pool, WeightService.create(pool, str(ckpt), "float32")
    return make


async def push(svc, weights, version, **kw):
    msgs = list(push_stream(weights, version, target=pb.TARGET_POLICY, chunk_bytes=kw.pop("chunk_bytes", 7), **kw))
    h = msgs[0].header
    header = Header(h.version, "policy", h.total_bytes, h.sha256, "wait", h.partial)

    async def chunks():
        for m in msgs[1:]:
            c = m.chunk
            yield Chunk(c.name, c.dtype, tuple(c.shape), c.offset, c.data)
    return await svc.push(header, chunks())


def test_push_commits_on_every_engine_with_exact_values(setup):
    async def main():
        pool, svc = await setup()
        new = {"a.weight": torch.arange(12.0).reshape(4, 3), "b.bias": torch.full((5,), 2.0, dtype=torch.bfloat16)}
        out = await push(svc, new, 1)
        assert out.version == 1 and out.num_tensors == 2 and not out.partial
        for e in pool.engines:
            assert torch.equal(e.weights["a.weight"], new["a.weight"]) and e.policy_version == 1
            assert [ev[0] for ev in e.events] == ["pause", "load", "resume"]
        assert pool.policy_version == 1
    asyncio.run(main())


def test_serving_dtype_is_accepted_other_dtypes_are_not(setup):
    async def main():
        pool, svc = await setup()
        await push(svc, {"b.bias": torch.ones(5, dtype=torch.float32)}, 1, partial=True)   # serving dtype
        with pytest.raises(ServiceError) as e:
            await push(svc, {"b.bias": torch.ones(5, dtype=torch.float16)}, 2, partial=True)
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "float16" in e.value.message
    asyncio.run(main())


def test_engine_failure_rolls_back_every_engine(setup):
    async def main():
        pool, svc = await setup()
        first = {"a.weight": torch.full((4, 3), 1.0), "b.bias": torch.ones(5, dtype=torch.bfloat16)}
        await push(svc, first, 1)
        pool.engines[1].fail_load = 1           # engine 1 fails on the next load
        with pytest.raises(ServiceError) as e:
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True)
        assert e.value.code is grpc.StatusCode.INTERNAL and "still serves policy version 1" in e.value.message
        for eng in pool.engines:                # engine 0 had loaded v2's value: restored to v1's
            assert torch.equal(eng.weights["a.weight"], first["a.weight"])
            assert eng.policy_version == 1 and eng.state.name == "READY"
        out = await push(svc, {"a.weight": torch.full((4, 3), 3.0)}, 2, partial=True)   # and pushes work again
        assert out.version == 2
    asyncio.run(main())


def test_rollback_restores_checkpoint_values_for_never_pushed_tensors(setup):
    async def main():
        pool, svc = await setup()
        pool.engines[1].fail_load = 1
        with pytest.raises(ServiceError):
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 1, partial=True)
        assert torch.equal(pool.engines[0].weights["a.weight"], ORIGINAL["a.weight"])
        assert pool.policy_version == 0
    asyncio.run(main())


def test_engine_that_cannot_be_restored_is_restarted_at_the_committed_version(setup):
    async def main():
        pool, svc = await setup()
        first = {"a.weight": torch.full((4, 3), 1.0)}
        await push(svc, first, 1, partial=True)
        pool.engines[0].fail_load = 2           # fails the load and the restore
        with pytest.raises(ServiceError):
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True)
        eng = pool.engines[0]
        assert eng.state.name == "UNHEALTHY" and not pool.ready
        await asyncio.gather(*svc.committer.restarts)
        assert eng.state.name == "READY" and pool.ready
        assert torch.equal(eng.weights["a.weight"], first["a.weight"]) and eng.policy_version == 1
    asyncio.run(main())


def test_checksum_and_size_are_checked(setup):
    async def main():
        pool, svc = await setup()
        data = torch.zeros(4, 3).numpy().tobytes()
        bad = Header(1, "policy", len(data), hashlib.sha256(b"other").hexdigest(), "wait", True)

        async def one():
            yield Chunk("a.weight", "float32", (4, 3), 0, data)
        with pytest.raises(ServiceError, match="sha256 mismatch"):
            await svc.push(bad, one())
        short = Header(1, "policy", len(data) + 4, hashlib.sha256(data).hexdigest(), "wait", True)
        with pytest.raises(ServiceError, match="cut short"):
            await svc.push(short, one())
        assert all(not e.events for e in pool.engines)      # nothing reached an engine
    asyncio.run(main())


def test_concurrent_pushes_serialize_and_stale_ones_fail(setup):
    async def main():
        pool, svc = await setup()
        w = {"a.weight": torch.ones(4, 3)}
        results = await asyncio.gather(*(push(svc, w, v, partial=True) for v in (3, 1, 2)), return_exceptions=True)
        ok = [r.version for r in results if not isinstance(r, Exception)]
        bad = [r for r in results if isinstance(r, Exception)]
        assert 3 in ok and all(r.code is grpc.StatusCode.FAILED_PRECONDITION for r in bad)
        assert pool.policy_version == 3
        events = [ev[0] for ev in pool.engines[0].events]
        assert events == ["pause", "load", "resume"] * len(ok)    # never two commits interleaved
    asyncio.run(main())
