"""EnginePool routing, admission, idempotency and cancellation, on FakeEngine (no vLLM)."""
import asyncio

import grpc
import pytest

from tests.fake_engine import FakeEngine
from rollout_service.engine.types import SeqRequest
from rollout_service.errors import ServiceError
from rollout_service.pool.pool import EnginePool


def groups(prompts: int, n: int, max_tokens: int = 5, tag: str = "r", seed: int | None = 1):
    return [[SeqRequest(seq_id=f"{tag}-{p}-{s}", prompt_token_ids=[p + 1], max_tokens=max_tokens,
                        seed=None if seed is None else seed * 1000 + p * 10 + s)
             for s in range(n)] for p in range(prompts)]


async def collect(pool, rec):
    pool.attach(rec)
    try:
        return [item async for item in rec.read()]
    finally:
        pool.detach(rec)


async def make_pool(engines=2, **kw):
    pool = EnginePool([FakeEngine(f"e{i}") for i in range(engines)], max_queue=kw.pop("max_queue", 100), **kw)
    await pool.start()
    return pool


def test_every_sample_arrives_once_and_groups_stay_on_one_engine():
    async def main():
        pool = await make_pool(2)
        rec = pool.submit("", b"x", groups(prompts=6, n=4))
        items = await collect(pool, rec)
        assert sorted((i.prompt_index, i.sample_index) for i in items) == [(p, s) for p in range(6) for s in range(4)]
        for p in range(6):   # every sample of one prompt ran on the same engine
            owners = {e.id for e in pool.engines for r in e.seen if r.seq_id.startswith(f"r-{p}-")}
            assert len(owners) == 1, owners
        assert {len(e.seen) for e in pool.engines} == {12}   # least-loaded routing spreads groups evenly
        assert pool.depth == 0 and all(v == 0 for v in pool.load.values())
        assert pool.telemetry.samples_total == 24 and pool.telemetry.tokens_total == 24 * 5
    asyncio.run(main())


def test_queue_bound_rejects_with_resource_exhausted_and_serves_on():
    async def main():
        pool = await make_pool(1, max_queue=8)
        first = pool.submit("", b"a", groups(2, 4, max_tokens=50))
        with pytest.raises(ServiceError) as e:
            pool.submit("", b"b", groups(1, 1, tag="b"))
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue is 8" in e.value.message
        assert len(await collect(pool, first)) == 8
        assert len(await collect(pool, pool.submit("", b"b", groups(1, 1, tag="b")))) == 1
    asyncio.run(main())


def test_retry_with_same_request_id_replays_without_regenerating():
    async def main():
        pool = await make_pool(1)
        rec = pool.submit("job-1", b"same", groups(2, 2))
        first = await collect(pool, rec)
        calls = pool.engines[0].calls
        again = await collect(pool, pool.submit("job-1", b"same", groups(2, 2, tag="retry")))
        assert pool.engines[0].calls == calls          # nothing regenerated
        assert [(i.prompt_index, i.sample_index, i.result.token_ids) for i in again] == \
               [(i.prompt_index, i.sample_index, i.result.token_ids) for i in first]
        with pytest.raises(ServiceError) as e:
            pool.submit("job-1", b"different", groups(1, 1))
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "job-1" in e.value.message
    asyncio.run(main())


def test_retry_while_running_attaches_to_the_same_work():
    async def main():
        pool = await make_pool(1)
        a = pool.submit("job-2", b"f", groups(1, 3, max_tokens=30))
        b = pool.submit("job-2", b"f", groups(1, 3, max_tokens=30))
        assert a is b
        ra, rb = await asyncio.gather(collect(pool, a), collect(pool, b))
        assert len(ra) == len(rb) == 3 and pool.engines[0].calls == 3
    asyncio.run(main())


def test_last_reader_leaving_aborts_engine_sequences():
    async def main():
        pool = await make_pool(1)
        eng = pool.engines[0]
        rec = pool.submit("job-3", b"f", groups(2, 2, max_tokens=10_000))
        pool.attach(rec)
        await asyncio.sleep(0.05)
        assert len(eng.active) == 4
        pool.detach(rec)
        await asyncio.sleep(0.05)
        assert eng.active == set() and len(eng.aborted) == 4
        assert pool.depth == 0
        assert pool.requests.get("job-3") is None    # a later retry runs it again
    asyncio.run(main())


def test_engine_failure_fails_the_request_as_unavailable_and_pool_serves_on():
    async def main():
        pool = EnginePool([FakeEngine("e0", fail_after=2)], max_queue=10)
        await pool.start()
        with pytest.raises(ServiceError) as e:
            await collect(pool, pool.submit("", b"f", groups(1, 3, max_tokens=100)))
        assert e.value.code is grpc.StatusCode.UNAVAILABLE and "retry" in e.value.message
        await asyncio.sleep(0.01)
        assert pool.depth == 0
        pool.engines[0].fail_after = None
        assert len(await collect(pool, pool.submit("", b"g", groups(1, 2, tag="g")))) == 2
    asyncio.run(main())


def test_shutdown_fails_in_flight_with_unavailable():
    async def main():
        pool = await make_pool(1)
        rec = pool.submit("", b"f", groups(1, 2, max_tokens=10_000))
        reader = asyncio.create_task(collect(pool, rec))
        await asyncio.sleep(0.02)
        await pool.shutdown()
        with pytest.raises(ServiceError) as e:
            await reader
        assert e.value.code is grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.message
        with pytest.raises(ServiceError):
            pool.submit("", b"g", groups(1, 1))
    asyncio.run(main())


class VLLMClientError(Exception):
    """Stands in for vllm.exceptions.VLLMClientError (matched by class name; unit tests import no vLLM)."""


class VLLMValidationError(VLLMClientError):
    def __init__(self, message, parameter=None):
        super().__init__(message)
        self.parameter = parameter


class RefusingEngine(FakeEngine):
    async def generate(self, req):
        raise VLLMValidationError("temperature must be in [0, 2], got 7.0.", parameter="temperature")


def test_an_engine_refusing_the_request_is_invalid_argument_not_retry():
    async def main():
        pool = EnginePool([RefusingEngine("e0")], max_queue=10)
        await pool.start()
        with pytest.raises(ServiceError) as e:
            await collect(pool, pool.submit("x", b"f", groups(1, 1)))
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.temperature" in e.value.message and "do not retry" in e.value.message
        assert pool.depth == 0 and pool.ready
    asyncio.run(main())
