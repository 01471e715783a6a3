"""All-or-nothing commits: prepare, pause, swap and resume on every engine or none; rollback (FakeEngine)."""
import asyncio

import grpc
import pytest
import torch
from safetensors.torch import save_file

from rollout_service.engine.base import EngineState
from rollout_service.errors import ServiceError
from rollout_service.weights.service import Chunk, Header
from tests.unit.conftest import ORIGINAL, push


def test_push_commits_on_every_engine_with_exact_values(make_service):
    async def main():
        pool, svc = await make_service()
        new = {"a.weight": torch.arange(12.0).reshape(4, 3), "b.bias": torch.full((5,), 2.0, dtype=torch.bfloat16)}
        out = await push(svc, new, 1)
        assert out.version == 1 and out.num_tensors == 2 and not out.partial
        for e in pool.engines:
            assert torch.equal(e.weights["a.weight"], new["a.weight"]) and e.policy_version == 1
            assert [ev[0] for ev in e.events] == ["prepare", "pause", "swap", "resume"]
        assert pool.policy_version == 1
    asyncio.run(main())



def test_serving_dtype_is_accepted_other_dtypes_are_not(make_service):
    async def main():
        pool, svc = await make_service()
        await push(svc, {"b.bias": torch.ones(5, dtype=torch.float32)}, 1, partial=True)   # serving dtype
        with pytest.raises(ServiceError) as e:
            await push(svc, {"b.bias": torch.ones(5, dtype=torch.float16)}, 2, partial=True)
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "float16" in e.value.message
    asyncio.run(main())



def test_engine_failure_rolls_back_every_engine(make_service):
    from rollout_service import scratch

    async def main():
        pool, svc = await make_service()
        first = {"a.weight": torch.full((4, 3), 1.0), "b.bias": torch.ones(5, dtype=torch.bfloat16)}
        await push(svc, first, 1)
        pool.engines[1].fail_load = 1           # engine 1 fails on the next load
        with pytest.raises(ServiceError) as e:
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True)
        assert e.value.code is grpc.StatusCode.INTERNAL and "still serves policy version 1" in e.value.message
        assert not list(scratch.scratch_root().glob("*.safetensors")), "a failed commit removes its staged file"
        for eng in pool.engines:                # engine 0 had loaded v2's value: restored to v1's
            assert torch.equal(eng.weights["a.weight"], first["a.weight"])
            assert eng.policy_version == 1 and eng.state.name == "READY"
        out = await push(svc, {"a.weight": torch.full((4, 3), 3.0)}, 2, partial=True)   # and pushes work again
        assert out.version == 2
    asyncio.run(main())



def test_failed_prepare_changes_nothing_and_never_pauses(make_service):
    """An engine that cannot load the new weights beside the served ones fails the push before any engine
    pauses: every engine drops what it prepared and keeps serving the old version."""
    from rollout_service import scratch

    async def main():
        pool, svc = await make_service()
        first = {"a.weight": torch.full((4, 3), 1.0)}
        await push(svc, first, 1, partial=True)
        for e in pool.engines:
            e.events.clear()
        pool.engines[1].fail_prepare = 1
        with pytest.raises(ServiceError) as e:
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True)
        assert e.value.code is grpc.StatusCode.INTERNAL
        assert "nothing was applied" in e.value.message and "still serves policy version 1" in e.value.message
        assert not list(scratch.scratch_root().glob("*.safetensors"))
        for eng in pool.engines:
            assert [ev[0] for ev in eng.events] == ["prepare", "discard"]     # never paused
            assert eng.prepared is None and eng.state.name == "READY" and eng.policy_version == 1
            assert torch.equal(eng.weights["a.weight"], first["a.weight"])
        out = await push(svc, {"a.weight": torch.full((4, 3), 3.0)}, 2, partial=True)
        assert out.version == 2 and torch.equal(pool.engines[1].weights["a.weight"], torch.full((4, 3), 3.0))
    asyncio.run(main())



def test_in_place_engines_load_while_paused(make_service):
    """engine.weight_reload = "in_place": no second copy of the weights; the commit loads during the pause."""
    async def main():
        pool, svc = await make_service()
        pool.engines[0].in_place = True          # a pool may mix both: each engine says what it did
        new = {"a.weight": torch.full((4, 3), 4.0)}
        await push(svc, new, 1, partial=True)
        assert [ev[0] for ev in pool.engines[0].events] == ["prepare", "pause", "load", "resume"]
        assert [ev[0] for ev in pool.engines[1].events] == ["prepare", "pause", "swap", "resume"]
        for e in pool.engines:
            assert torch.equal(e.weights["a.weight"], new["a.weight"]) and e.policy_version == 1
        pool.engines[0].fail_load = 1            # an in-place failure rolls back like a swap failure
        with pytest.raises(ServiceError, match="still serves policy version 1"):
            await push(svc, {"a.weight": torch.full((4, 3), 8.0)}, 2, partial=True)
        for e in pool.engines:
            assert torch.equal(e.weights["a.weight"], new["a.weight"]) and e.state.name == "READY"
        pool.engines[1].in_place = True          # nothing prepared: the reply says so
        out = await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 3, partial=True)
        assert out.version == 3 and out.prepare_s == 0
        assert all(torch.equal(e.weights["a.weight"], torch.full((4, 3), 9.0)) for e in pool.engines)
    asyncio.run(main())



def test_failed_swap_drops_what_later_engines_prepared(make_service):
    async def main():
        pool, svc = await make_service()
        pool.engines[0].fail_load = 1           # engine 0 fails its swap; engine 1 never swaps
        with pytest.raises(ServiceError):
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 1, partial=True)
        assert pool.engines[1].prepared is None
        assert [ev[0] for ev in pool.engines[1].events] == ["prepare", "pause", "discard", "resume"]
        for eng in pool.engines:
            assert torch.equal(eng.weights.get("a.weight", ORIGINAL["a.weight"]), ORIGINAL["a.weight"])
    asyncio.run(main())



def test_failed_load_weights_leaves_the_callers_file_alone(make_service, tmp_path):
    async def main():
        pool, svc = await make_service()
        f = tmp_path / "mine.safetensors"
        save_file({"a.weight": torch.full((4, 3), 5.0)}, str(f))
        pool.engines[1].fail_load = 1
        with pytest.raises(ServiceError):
            await svc.load(str(f), 1, "policy", "wait", partial=True)
        assert f.exists() and pool.policy_version == 0
        out = await svc.load(str(f), 1, "policy", "wait", partial=True)
        assert out.version == 1 and f.exists()          # LoadWeights copies the file, never takes it
        assert torch.equal(pool.engines[0].weights["a.weight"], torch.full((4, 3), 5.0))
    asyncio.run(main())



def test_rollback_restores_checkpoint_values_for_never_pushed_tensors(make_service):
    async def main():
        pool, svc = await make_service()
        pool.engines[1].fail_load = 1
        with pytest.raises(ServiceError):
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 1, partial=True)
        assert torch.equal(pool.engines[0].weights["a.weight"], ORIGINAL["a.weight"])
        assert pool.policy_version == 0
    asyncio.run(main())



def test_concurrent_pushes_serialize_and_stale_ones_fail(make_service):
    async def main():
        pool, svc = await make_service()
        w = {"a.weight": torch.ones(4, 3)}
        results = await asyncio.gather(*(push(svc, w, v, partial=True) for v in (3, 1, 2)), return_exceptions=True)
        ok = [r.version for r in results if not isinstance(r, Exception)]
        bad = [r for r in results if isinstance(r, Exception)]
        assert 3 in ok and all(r.code is grpc.StatusCode.FAILED_PRECONDITION for r in bad)
        assert pool.policy_version == 3
        events = [ev[0] for ev in pool.engines[0].events]
        assert events == ["prepare", "pause", "swap", "resume"] * len(ok)    # never two commits interleaved
    asyncio.run(main())



def test_push_cancelled_during_its_commit_still_commits_on_every_engine_or_none(make_service, monkeypatch):
    """The client goes away (the RPC is cancelled) while engine 0 has swapped the new weights in and engine 1
    is still swapping: the commit runs to its end, so no engine stays paused or holds weights under a wrong
    version label, and the staging file is removed."""
    from rollout_service import scratch

    async def main():
        pool, svc = await make_service()
        slow = pool.engines[1]
        real_swap, loading = slow.swap_weights, asyncio.Event()

        async def slow_swap(target):
            loading.set()
            await asyncio.sleep(0.2)
            await real_swap(target)
        slow.swap_weights = slow_swap
        new = {"a.weight": torch.full((4, 3), 7.0)}
        task = asyncio.ensure_future(push(svc, new, 1, partial=True))
        await loading.wait()
        assert [ev[0] for ev in pool.engines[0].events] == ["prepare", "pause", "swap"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with pool.push_lock:          # the commit holds it until it has ended
            pass
        for e in pool.engines:
            assert e.state is not EngineState.PAUSED
            assert e.policy_version == 1 and torch.equal(e.weights["a.weight"], new["a.weight"])
        assert pool.policy_version == 1
        assert not list(scratch.scratch_root().glob("*.safetensors"))
    asyncio.run(main())


def test_a_cut_stream_cancelled_again_while_its_last_copy_ends_still_gives_up_its_file(make_service, monkeypatch):
    """The client's stream breaks (the push's own error) and gRPC then cancels the call while the push waits for the
    copy of the chunk before: the clean-up runs to its end, and the staging file becomes the spare (CI once found
    the cut push's file still in /dev/shm after 10 s)."""
    import threading
    import time

    from rollout_service import scratch
    from rollout_service.weights import staging

    async def main():
        pool, svc = await make_service()
        real_add, copying = staging.Stager.add, threading.Event()

        def slow_add(self, *a):
            copying.set()
            time.sleep(0.3)
            real_add(self, *a)
        monkeypatch.setattr(staging.Stager, "add", slow_add)
        data = torch.zeros(4, 3).numpy().tobytes()

        async def cut():
            yield Chunk("a.weight", "float32", (4, 3), 0, data[:24])
            await asyncio.to_thread(copying.wait)
            raise RuntimeError("the stream was cut")
        task = asyncio.ensure_future(svc.push(Header(1, "policy", len(data), "", "wait", True), cut()))
        await asyncio.to_thread(copying.wait)
        await asyncio.sleep(0.1)           # the stream has raised; the push waits for the copy to end
        task.cancel()                      # gRPC's cancellation of the call arrives
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(40):
            if not list(scratch.scratch_root().glob("*.safetensors")):
                break
            await asyncio.sleep(0.05)
        assert not list(scratch.scratch_root().glob("*.safetensors"))
        assert pool.policy_version == 0 and all(not e.events for e in pool.engines)
    asyncio.run(main())


def test_an_engine_dying_unanswered_during_a_commit_fails_it_retriable_and_releases_the_push_lock(make_service):
    """vLLM never answers a call (pause_generation, collective_rpc) sent to an engine core that then died: the commit
    held the push lock for good, so the supervisor could not restart the engine (found by bench/soak.py). Now the
    commit fails UNAVAILABLE, the other engines resume on the old version and the lock is free."""
    async def main():
        pool, svc = await make_service()
        await push(svc, {"a.weight": torch.full((4, 3), 1.0)}, 1, partial=True)
        e1 = pool.engines[1]
        e1.pause = e1.dies_unanswered()
        with pytest.raises(ServiceError) as e:
            await asyncio.wait_for(push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True), 10)
        assert e.value.code is grpc.StatusCode.UNAVAILABLE and "still serves policy version 1" in e.value.message
        assert not pool.push_lock.locked() and pool.policy_version == 1
        e0 = pool.engines[0]
        assert e0.state is EngineState.READY and torch.equal(e0.weights["a.weight"], torch.full((4, 3), 1.0))
    asyncio.run(main())
