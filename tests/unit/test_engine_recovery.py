"""Engines brought back or added at the committed versions: the supervisor's restarts, the scaler (FakeEngine)."""
import asyncio

import grpc
import pytest
import torch

from rollout_service.engine.base import EngineState
from tests.fake_engine import FakeEngine
from rollout_service.errors import ServiceError
from rollout_service.pool.supervisor import Supervisor
from tests.unit.conftest import push


def test_engine_that_cannot_be_restored_is_restarted_at_the_committed_version(make_service):
    async def main():
        pool, svc = await make_service()
        first = {"a.weight": torch.full((4, 3), 1.0)}
        await push(svc, first, 1, partial=True)
        pool.engines[0].fail_load = 2           # fails the load and the restore
        with pytest.raises(ServiceError):
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True)
        eng = pool.engines[0]
        assert eng.state.name == "UNHEALTHY" and not pool.ready
        sup = Supervisor(pool, pool.restart_at_committed)
        assert sup.check() == ["e0"]
        await asyncio.gather(*sup.restarting.values())
        assert eng.state.name == "READY" and pool.ready and eng.restarts == 1
        assert torch.equal(eng.weights["a.weight"], first["a.weight"]) and eng.policy_version == 1
    asyncio.run(main())



def test_dead_engine_fails_its_requests_as_retriable_and_comes_back_at_the_committed_versions(make_service):
    async def main():
        from rollout_service.engine.types import SeqRequest

        pool, svc = await make_service()
        pushed = {"a.weight": torch.full((4, 3), 3.0)}
        await push(svc, pushed, 1, partial=True)
        sup = Supervisor(pool, pool.restart_at_committed)
        assert sup.check() == []                                      # healthy engines are left alone
        groups = [[SeqRequest(seq_id=f"s-{p}", prompt_token_ids=[1], max_tokens=10_000)] for p in range(2)]
        rec = pool.submit("req-1", b"fp", groups)                    # one sequence on each engine
        await asyncio.sleep(0.05)
        dead = pool.engines[0]
        dead.kill()
        with pytest.raises(ServiceError) as err:
            async for _ in rec.read():
                pass
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "retry" in err.value.message
        assert sup.check() == ["e0"] and dead.state.name == "UNHEALTHY"
        assert sup.check() == []                                      # one restart at a time
        await asyncio.gather(*sup.restarting.values())
        assert dead.state.name == "READY" and dead.restarts == 1 and dead.starts == 2
        assert torch.equal(dead.weights["a.weight"], pushed["a.weight"]) and dead.policy_version == 1
        assert pool.depth == 0 and all(v == 0 for v in pool.load.values())   # nothing leaked
        again = pool.submit("req-1", b"fp", [[SeqRequest(seq_id="t", prompt_token_ids=[1], max_tokens=3)]])
        assert again is not rec                                       # the failed id runs again
        assert len([x async for x in again.read()]) == 1
    asyncio.run(main())



def test_failing_restarts_back_off_and_keep_the_engine_out_of_service(make_service):
    async def main():
        pool, svc = await make_service()
        sup = Supervisor(pool, pool.restart_at_committed, max_backoff_s=0.01)
        eng = pool.engines[1]
        eng.kill()
        eng.fail_starts = 2
        for attempt in range(3):
            assert sup.check() == ["e1"]
            await asyncio.gather(*sup.restarting.values())
            assert eng.state.name == ("READY" if attempt == 2 else "UNHEALTHY")
        assert eng.restarts == 1 and eng.starts == 4 and pool.ready and sup.failures == {}
    asyncio.run(main())



def test_scale_out_starts_at_the_committed_versions_and_scale_in_drops_nothing(make_service):
    async def main():
        from rollout_service.engine.types import SeqRequest
        from rollout_service.pool.scaling import Scaler

        pool, svc = await make_service()
        pushed = {"a.weight": torch.full((4, 3), 5.0)}
        await push(svc, pushed, 1, partial=True)
        scaler = Scaler(pool, lambda eid: FakeEngine(eid, step_s=0.002))
        await scaler.scale(3)
        new = pool.engines[2]
        assert new.id == "engine-2"
        assert new.state.name == "READY" and new.policy_version == 1 and pool.ready
        assert torch.equal(new.weights["a.weight"], pushed["a.weight"])
        # Work on every engine, then shrink to one engine while it runs: every sample still arrives.
        groups = [[SeqRequest(seq_id=f"q-{p}", prompt_token_ids=[1], max_tokens=100)] for p in range(6)]
        rec = pool.submit("scale-in", b"fp", groups)
        assert {pool.load[e.id] > 0 for e in pool.engines} == {True}
        shrink = asyncio.create_task(scaler.scale(1))
        results = [x async for x in rec.read()]
        await shrink
        assert len(results) == 6 and [e.id for e in pool.engines] == ["e0"]
        assert new.state.name == "STOPPED" and pool.draining == set()
        with pytest.raises(ServiceError) as err:
            await scaler.scale(0)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    asyncio.run(main())


def test_a_dead_engine_is_logged_with_its_reason_even_when_it_marked_itself_unhealthy(make_service, caplog):
    """vLLM's engine marks itself UNHEALTHY when generate fails on a dead core, before the supervisor looks;
    the supervisor still logs why it restarts it (operators, and test_faults, read "engine core died" there)."""
    async def main():
        pool, svc = await make_service()
        dead = pool.engines[0]
        dead.kill()
        dead.state = EngineState.UNHEALTHY
        sup = Supervisor(pool, pool.restart_at_committed)
        with caplog.at_level("ERROR", logger="rollout_service.pool.pool"):
            assert sup.check() == ["e0"]
        await asyncio.gather(*sup.restarting.values())
        assert "e0: engine is dead (killed)" in caplog.text and dead.state is EngineState.READY
    asyncio.run(main())
