"""Staging validation and all-or-nothing commits, on FakeEngine (no vLLM)."""
import asyncio
import hashlib

import grpc
import pytest
import torch
from safetensors.torch import save_file

from rollout_client.weights import push_stream
from rollout_service.api import pb
from rollout_service.engine.base import EngineState
from rollout_service.engine.fake import FakeEngine
from rollout_service.errors import ServiceError
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.supervisor import Supervisor
from rollout_service.weights.service import Chunk, Header, Trailer, WeightService

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
        return pool, WeightService.create(pool, str(ckpt), "float32", weights_roots=[str(tmp_path)])
    return make


async def push(svc, weights, version, **kw):
    msgs = list(push_stream(weights, version, target=pb.TARGET_POLICY, chunk_bytes=kw.pop("chunk_bytes", 7), **kw))
    h = msgs[0].header
    header = Header(h.version, "policy", h.total_bytes, h.sha256, "wait", h.partial)

    async def chunks():
        for m in msgs[1:]:
            if m.WhichOneof("item") == "trailer":
                yield Trailer(m.trailer.sha256)
                continue
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
            assert [ev[0] for ev in e.events] == ["prepare", "pause", "swap", "resume"]
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
    from rollout_service.weights import staging

    async def main():
        pool, svc = await setup()
        first = {"a.weight": torch.full((4, 3), 1.0), "b.bias": torch.ones(5, dtype=torch.bfloat16)}
        await push(svc, first, 1)
        pool.engines[1].fail_load = 1           # engine 1 fails on the next load
        with pytest.raises(ServiceError) as e:
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True)
        assert e.value.code is grpc.StatusCode.INTERNAL and "still serves policy version 1" in e.value.message
        assert not list(staging.staging_root().glob("*.safetensors")), "a failed commit removes its staged file"
        for eng in pool.engines:                # engine 0 had loaded v2's value: restored to v1's
            assert torch.equal(eng.weights["a.weight"], first["a.weight"])
            assert eng.policy_version == 1 and eng.state.name == "READY"
        out = await push(svc, {"a.weight": torch.full((4, 3), 3.0)}, 2, partial=True)   # and pushes work again
        assert out.version == 2
    asyncio.run(main())


def test_failed_prepare_changes_nothing_and_never_pauses(setup):
    """An engine that cannot load the new weights beside the served ones fails the push before any engine
    pauses: every engine drops what it prepared and keeps serving the old version."""
    from rollout_service.weights import staging

    async def main():
        pool, svc = await setup()
        first = {"a.weight": torch.full((4, 3), 1.0)}
        await push(svc, first, 1, partial=True)
        for e in pool.engines:
            e.events.clear()
        pool.engines[1].fail_prepare = 1
        with pytest.raises(ServiceError) as e:
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 2, partial=True)
        assert e.value.code is grpc.StatusCode.INTERNAL
        assert "nothing was applied" in e.value.message and "still serves policy version 1" in e.value.message
        assert not list(staging.staging_root().glob("*.safetensors"))
        for eng in pool.engines:
            assert [ev[0] for ev in eng.events] == ["prepare", "discard"]     # never paused
            assert eng.prepared is None and eng.state.name == "READY" and eng.policy_version == 1
            assert torch.equal(eng.weights["a.weight"], first["a.weight"])
        out = await push(svc, {"a.weight": torch.full((4, 3), 3.0)}, 2, partial=True)
        assert out.version == 2 and torch.equal(pool.engines[1].weights["a.weight"], torch.full((4, 3), 3.0))
    asyncio.run(main())


def test_in_place_engines_load_while_paused(setup):
    """engine.weight_reload = "in_place": no second copy of the weights; the commit loads during the pause."""
    async def main():
        pool, svc = await setup()
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


def test_failed_swap_drops_what_later_engines_prepared(setup):
    async def main():
        pool, svc = await setup()
        pool.engines[0].fail_load = 1           # engine 0 fails its swap; engine 1 never swaps
        with pytest.raises(ServiceError):
            await push(svc, {"a.weight": torch.full((4, 3), 9.0)}, 1, partial=True)
        assert pool.engines[1].prepared is None
        assert [ev[0] for ev in pool.engines[1].events] == ["prepare", "pause", "discard", "resume"]
        for eng in pool.engines:
            assert torch.equal(eng.weights.get("a.weight", ORIGINAL["a.weight"]), ORIGINAL["a.weight"])
    asyncio.run(main())


def test_failed_load_weights_leaves_the_callers_file_alone(setup, tmp_path):
    async def main():
        pool, svc = await setup()
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
        sup = Supervisor(pool, svc.committer.restart_at_committed)
        assert sup.check() == ["e0"]
        await asyncio.gather(*sup.restarting.values())
        assert eng.state.name == "READY" and pool.ready and eng.restarts == 1
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


def test_checksum_in_the_trailer(setup):
    """The sha256 may come last (the client hashes while it streams): exactly one of header and trailer
    carries it, a wrong one fails like a wrong header checksum, and none at all is refused."""
    async def main():
        pool, svc = await setup()
        data = torch.ones(4, 3).numpy().tobytes()
        good = hashlib.sha256(data).hexdigest()

        def stream(trailer):
            async def gen():
                yield Chunk("a.weight", "float32", (4, 3), 0, data)
                if trailer is not None:
                    yield Trailer(trailer)
            return gen()
        for header_sha, trailer, needle in [("", "0" * 64, "sha256 mismatch"), ("", None, "no sha256"),
                                            (good, good, "came twice"), ("", "xyz", "64 hex")]:
            with pytest.raises(ServiceError, match=needle):
                await svc.push(Header(1, "policy", len(data), header_sha, "wait", True), stream(trailer))
        assert all(not e.events for e in pool.engines) and pool.policy_version == 0
        out = await svc.push(Header(1, "policy", len(data), "", "wait", True), stream(good))
        assert out.version == 1 and pool.policy_version == 1
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
        assert events == ["prepare", "pause", "swap", "resume"] * len(ok)    # never two commits interleaved
    asyncio.run(main())


def test_dead_engine_fails_its_requests_as_retriable_and_comes_back_at_the_committed_versions(setup):
    async def main():
        from rollout_service.engine.types import SeqRequest

        pool, svc = await setup()
        pushed = {"a.weight": torch.full((4, 3), 3.0)}
        await push(svc, pushed, 1, partial=True)
        sup = Supervisor(pool, svc.committer.restart_at_committed)
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


def test_recycled_staging_never_overwrites_a_committed_value(setup):
    """Superseded and failed pushes become the spare the next push stages into. A file still holding a
    committed value (v1's b.bias after a partial v2) is never recycled: failed pushes that scribble into
    the spare leave every overlay intact, and a restarted engine gets exactly the committed values."""
    from rollout_service.weights import staging

    async def main():
        pool, svc = await setup()
        one = {"a.weight": torch.full((4, 3), 1.0), "b.bias": torch.full((5,), 1.0, dtype=torch.bfloat16)}
        await push(svc, one, 1)
        await push(svc, {"a.weight": torch.full((4, 3), 2.0)}, 2, partial=True)

        async def failed_push(version):
            garbage = torch.full((5,), 9.0, dtype=torch.bfloat16).view(torch.uint8)
            data = torch.full((4, 3), 9.0).numpy().tobytes() + garbage.numpy().tobytes()

            async def chunks():
                yield Chunk("a.weight", "float32", (4, 3), 0, data[:48])
                yield Chunk("b.bias", "bfloat16", (5,), 0, data[48:])
            with pytest.raises(ServiceError, match="sha256 mismatch"):
                await svc.push(Header(version, "policy", len(data), "0" * 64, "wait", False), chunks())
        await failed_push(3)
        await push(svc, {"a.weight": torch.full((4, 3), 3.0)}, 3, partial=True)    # v2's file superseded
        await failed_push(4)
        root = staging.staging_root()
        assert (root / staging.SPARE_NAME).exists() and not list(root.glob("*.safetensors"))
        assert len(list((root / "committed" / "policy").glob("*.safetensors"))) == 2      # v1 (b.bias), v3 (a)
        dead = pool.engines[0]
        dead.kill()
        sup = Supervisor(pool, svc.committer.restart_at_committed)
        assert sup.check() == ["e0"]
        await asyncio.gather(*sup.restarting.values())
        assert torch.equal(dead.weights["a.weight"], torch.full((4, 3), 3.0))
        assert torch.equal(dead.weights["b.bias"], torch.full((5,), 1.0, dtype=torch.bfloat16))
        assert dead.policy_version == 3
    asyncio.run(main())


def test_failing_restarts_back_off_and_keep_the_engine_out_of_service(setup):
    async def main():
        pool, svc = await setup()
        sup = Supervisor(pool, svc.committer.restart_at_committed, max_backoff_s=0.01)
        eng = pool.engines[1]
        eng.kill()
        eng.fail_starts = 2
        for attempt in range(3):
            assert sup.check() == ["e1"]
            await asyncio.gather(*sup.restarting.values())
            assert eng.state.name == ("READY" if attempt == 2 else "UNHEALTHY")
        assert eng.restarts == 1 and eng.starts == 4 and pool.ready and sup.failures == {}
    asyncio.run(main())


def test_scale_out_starts_at_the_committed_versions_and_scale_in_drops_nothing(setup):
    async def main():
        from rollout_service.engine.types import SeqRequest
        from rollout_service.pool.scaling import Scaler

        pool, svc = await setup()
        pushed = {"a.weight": torch.full((4, 3), 5.0)}
        await push(svc, pushed, 1, partial=True)
        scaler = Scaler(pool, svc.committer, lambda eid: FakeEngine(eid, step_s=0.002))
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


def test_push_cancelled_during_its_commit_still_commits_on_every_engine_or_none(setup, monkeypatch):
    """The client goes away (the RPC is cancelled) while engine 0 has swapped the new weights in and engine 1
    is still swapping: the commit runs to its end, so no engine stays paused or holds weights under a wrong
    version label, and the staging file is removed."""
    from rollout_service.weights import staging

    async def main():
        pool, svc = await setup()
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
        async with svc.committer.lock:          # the commit holds it until it has ended
            pass
        for e in pool.engines:
            assert e.state is not EngineState.PAUSED
            assert e.policy_version == 1 and torch.equal(e.weights["a.weight"], new["a.weight"])
        assert pool.policy_version == 1
        assert not list(staging.staging_root().glob("*.safetensors"))
    asyncio.run(main())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_staging_file_is_the_safetensors_format(tmp_path, dtype):
    """The stager's file reads back through safetensors itself, byte for byte: odd shapes, a scalar, an empty
    tensor, tensors split over several chunks in any order, a tensor left out (partial), an ignored one."""
    from safetensors import safe_open

    from rollout_service.weights.manifest import Manifest, TensorSpec
    from rollout_service.weights.staging import Stager

    name = str(dtype).removeprefix("torch.")
    tensors = {"a": torch.randn(3, 5).to(dtype), "scalar": torch.tensor(2.5, dtype=dtype),
               "empty": torch.zeros(0, 4, dtype=dtype), "odd": torch.randn(7).to(dtype)}
    manifest = Manifest({**{n: TensorSpec(name, tuple(t.shape)) for n, t in tensors.items()},
                         "left_out": TensorSpec(name, (2, 2))}, frozenset({"tied"}), "float32")
    chunks = []
    for n, t in list(tensors.items()) + [("tied", torch.ones(3, dtype=dtype))]:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        parts = [(o, raw[o:o + 6]) for o in range(0, len(raw), 6)] or [(0, b"")]
        chunks += [(n, name, tuple(t.shape), o, d) for o, d in reversed(parts)]
    digest = hashlib.sha256(b"".join(c[4] for c in chunks)).hexdigest()
    stager = Stager(manifest, sum(len(c[4]) for c in chunks), digest, True, tmp_path)
    for c in chunks:
        stager.add(*c)
    staged = stager.finish()
    assert staged.partial and sorted(staged.names) == sorted(tensors)
    with safe_open(str(staged.path), "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for n, t in tensors.items():
            got = f.get_tensor(n)
            assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)


def test_failed_or_cut_staging_leaves_only_the_spare(tmp_path):
    """A checksum mismatch, an incomplete tensor or a push abandoned mid-stream gives up its staging file:
    at most one file stays, the spare, and the next push stages into it (its stale bytes overwritten)."""
    from safetensors import safe_open

    from rollout_service.weights.manifest import Manifest, TensorSpec
    from rollout_service.weights.staging import SPARE_NAME, Stager

    manifest = Manifest({"w": TensorSpec("float32", (4,))}, frozenset(), "float32")
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    good = hashlib.sha256(data).hexdigest()
    bad = Stager(manifest, len(data), "0" * 64, False, tmp_path)
    bad.add("w", "float32", (4,), 0, data)
    with pytest.raises(ServiceError, match="sha256 mismatch"):
        bad.finish()
    assert [p.name for p in tmp_path.iterdir()] == [SPARE_NAME]
    short = Stager(manifest, 8, hashlib.sha256(data[:8]).hexdigest(), False, tmp_path)
    assert short.recycled_bytes > 0
    short.add("w", "float32", (4,), 0, data[:8])
    with pytest.raises(ServiceError, match="incomplete"):
        short.finish()
    cut = Stager(manifest, len(data), good, False, tmp_path)
    cut.add("w", "float32", (4,), 0, data[:8])
    assert len(list(tmp_path.iterdir())) == 1
    cut.discard()
    assert [p.name for p in tmp_path.iterdir()] == [SPARE_NAME]
    new = torch.full((4,), 7.0).numpy().tobytes()
    again = Stager(manifest, len(new), hashlib.sha256(new).hexdigest(), False, tmp_path)
    assert again.recycled_bytes > 0 and not (tmp_path / SPARE_NAME).exists()
    again.add("w", "float32", (4,), 0, new)
    staged = again.finish()
    with safe_open(str(staged.path), "pt") as f:
        assert torch.equal(f.get_tensor("w"), torch.full((4,), 7.0))


def test_overlapping_chunks_are_refused(tmp_path):
    """Chunks of a tensor may come in any order but must not overlap: otherwise byte counts could add up
    with a gap left unwritten (stale bytes of a recycled staging file)."""
    from rollout_service.weights.manifest import Manifest, TensorSpec
    from rollout_service.weights.staging import Stager

    manifest = Manifest({"w": TensorSpec("float32", (4,))}, frozenset(), "float32")
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    stager = Stager(manifest, 64, "0" * 64, False, tmp_path)
    stager.add("w", "float32", (4,), 8, data[8:])
    stager.add("w", "float32", (4,), 0, data[:8])
    with pytest.raises(ServiceError, match="overlaps"):
        stager.add("w", "float32", (4,), 4, data[4:8])
    stager.discard()
    again = Stager(manifest, 64, "0" * 64, False, tmp_path)
    again.add("w", "float32", (4,), 0, data[:8])
    with pytest.raises(ServiceError, match="overlaps"):
        again.add("w", "float32", (4,), 0, data[:8])
    again.discard()


def test_start_up_sweeps_staging_left_by_dead_servers(tmp_path, monkeypatch):
    """A server killed before it could clean up leaves its staging folder (RAM, on /dev/shm); the next server
    removes it at start-up, and only folders of processes that no longer run."""
    import os
    import subprocess

    from rollout_service.weights import staging

    monkeypatch.setattr(staging, "_staging_base", lambda: tmp_path)
    proc = subprocess.Popen(["true"])
    proc.wait()
    dead = proc.pid
    (tmp_path / f"rollout-service-{dead}" / "committed").mkdir(parents=True)
    (tmp_path / f"rollout-service-{dead}" / "committed" / "v1.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / f"rollout-service-{os.getppid()}").mkdir()                   # a live process: kept
    (tmp_path / "rollout-service-notapid").mkdir()                           # not ours: kept
    assert staging.sweep_stale_roots() == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"rollout-service-{os.getppid()}",
                                                                 "rollout-service-notapid"])
    root = staging.staging_root()
    assert root.is_dir() and root.name == f"rollout-service-{os.getpid()}"
    staging.remove_staging_root()
    assert not root.exists()
