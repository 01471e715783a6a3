"""Durable commits (pool/committed.py with a state_dir): a new server process on the same state_dir serves the
last committed versions; a server SIGKILLed at any phase of a commit restarts at the old or the new version,
never a mixture. FakeEngines hold the tensors they were given, so the values each version serves are checked."""
import asyncio

import grpc
import pytest
import torch

from rollout_service.config import ConfigError
from rollout_service.faults import COMMIT_POINTS
from rollout_service.pool.pool import EnginePool
from rollout_service.server.convert import status_to_proto
from rollout_service.weights.service import WeightService
from tests.fake_engine import FakeEngine
from tests.unit.conftest import ORIGINAL, push, push_then_crash, run_until_killed, write_checkpoint

V1 = {"a.weight": torch.full((4, 3), 1.0), "b.bias": torch.full((5,), 1.0, dtype=torch.bfloat16)}
V2 = {"a.weight": torch.full((4, 3), 2.0), "b.bias": torch.full((5,), 2.0, dtype=torch.bfloat16)}


@pytest.fixture
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "ckpt")


async def _server(ckpt, state_dir, engines=2):
    pool = EnginePool([FakeEngine(f"e{i}") for i in range(engines)], max_queue=10, checkpoints={"policy": ckpt},
                      state_dir=state_dir)
    await pool.start()
    return pool, WeightService.create(pool, "float32", weights_roots=[str(ckpt)])


def _served(pool, names=("a.weight", "b.bias")):
    """What every engine serves for `names` (checked equal across engines)."""
    values = [{n: e.weights.get(n, ORIGINAL[n]) for n in names} for e in pool.engines]
    for v in values[1:]:
        assert all(torch.equal(v[n], values[0][n]) for n in names), "engines serve different values"
    return values[0]


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_a_new_server_on_the_state_dir_serves_the_committed_versions(ckpt, tmp_path):
    state = tmp_path / "state"

    async def main():
        pool, svc = await _server(ckpt, state)
        await push(svc, {"a.weight": V1["a.weight"]}, 1, partial=True)
        await push(svc, {"b.bias": V2["b.bias"]}, 2, partial=True)       # a partial push overlays the first
        assert pool.committed.restored == {"policy": 0, "drafter": 0}
        again, _ = await _server(ckpt, state)
        assert again.policy_version == 2 and all(e.policy_version == 2 for e in again.engines)
        assert _same(_served(again), {"a.weight": V1["a.weight"], "b.bias": V2["b.bias"]})
        status = status_to_proto(again, "m", 10, 10)
        assert status.durability.state_dir == str(state) and status.durability.restored_policy_version == 2
        assert sorted(p.name for p in (state / "policy").iterdir()) == ["v1-0.safetensors", "v2-0.safetensors"]
    asyncio.run(main())


def test_without_a_state_dir_a_new_server_starts_at_version_zero_and_says_so(ckpt):
    async def main():
        pool, svc = await _server(ckpt, "")
        await push(svc, V1, 1)
        again, _ = await _server(ckpt, "")
        assert again.policy_version == 0 and _same(_served(again), ORIGINAL)
        assert status_to_proto(again, "m", 10, 10).durability.state_dir == ""
    asyncio.run(main())


def test_a_state_dir_of_another_model_is_refused_naming_it(ckpt, tmp_path):
    state = tmp_path / "state"

    async def main():
        _, svc = await _server(ckpt, state)
        await push(svc, V1, 1)
        (ckpt / "config.json").write_text('{"hidden_size": 64}')          # another model in the same place
        with pytest.raises(ConfigError) as e:
            await _server(ckpt, state)
        assert str(state) in str(e.value) and "policy version 1" in str(e.value)
    asyncio.run(main())


def test_versions_still_increase_after_a_restart(ckpt, tmp_path):
    from rollout_service.errors import ServiceError

    async def main():
        _, svc = await _server(ckpt, tmp_path / "state")
        await push(svc, V1, 3)
        _, again = await _server(ckpt, tmp_path / "state")
        with pytest.raises(ServiceError) as e:
            await push(again, V2, 3)
        assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION and "not newer" in e.value.message
    asyncio.run(main())


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_a_server_killed_at_any_phase_of_a_commit_restarts_at_the_old_or_the_new_version(ckpt, tmp_path, point):
    state = tmp_path / "state"
    async def start():
        return (await _server(ckpt, state))[1]
    run_until_killed(push_then_crash, (start, lambda svc: push(svc, V1, 1), lambda svc: push(svc, V2, 2), point),
                     point)

    async def main():
        pool, svc = await _server(ckpt, state)
        expected = 2 if point == "manifest_written" else 1     # the record is the commit's last word
        assert pool.policy_version == expected
        assert _same(_served(pool), V2 if expected == 2 else V1), f"a mixture after a kill at {point}"
        live = set(pool.committed.overlay["policy"].values())
        assert set((state / "policy").glob("*.safetensors")) == live, "files of the killed commit left behind"
        if expected == 1:                          # the trainer pushes version 2 again
            await push(svc, V2, 2)
            assert _same(_served(pool), V2)
    asyncio.run(main())
