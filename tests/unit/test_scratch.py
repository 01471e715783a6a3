"""The scratch folder: the spare staging file recycled between pushes, and folders of dead servers swept."""
import asyncio
import hashlib

import pytest
import torch

from rollout_service.errors import ServiceError
from rollout_service.pool.supervisor import Supervisor
from rollout_service.weights.service import Chunk, Header
from tests.unit.conftest import push


def test_failed_or_cut_staging_leaves_only_the_spare(tmp_path):
    """A checksum mismatch, an incomplete tensor or a push abandoned mid-stream gives up its staging file:
    at most one file stays, the spare, and the next push stages into it (its stale bytes overwritten)."""
    from safetensors import safe_open

    from rollout_service.weights.manifest import Manifest, TensorSpec
    from rollout_service.scratch import SPARE_NAME
    from rollout_service.weights.staging import Stager

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



def test_recycled_staging_never_overwrites_a_committed_value(make_service):
    """Superseded and failed pushes become the spare the next push stages into. A file still holding a
    committed value (v1's b.bias after a partial v2) is never recycled: failed pushes that scribble into
    the spare leave every overlay intact, and a restarted engine gets exactly the committed values."""
    from rollout_service import scratch

    async def main():
        pool, svc = await make_service()
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
        root = scratch.scratch_root()
        assert (root / scratch.SPARE_NAME).exists() and not list(root.glob("*.safetensors"))
        assert len(list((root / "committed" / "policy").glob("*.safetensors"))) == 2      # v1 (b.bias), v3 (a)
        dead = pool.engines[0]
        dead.kill()
        sup = Supervisor(pool, pool.restart_at_committed)
        assert sup.check() == ["e0"]
        await asyncio.gather(*sup.restarting.values())
        assert torch.equal(dead.weights["a.weight"], torch.full((4, 3), 3.0))
        assert torch.equal(dead.weights["b.bias"], torch.full((5,), 1.0, dtype=torch.bfloat16))
        assert dead.policy_version == 3
    asyncio.run(main())



def test_start_up_sweeps_staging_left_by_dead_servers(tmp_path, monkeypatch):
    """A server killed before it could clean up leaves its staging folder (RAM, on /dev/shm); the next server
    removes it at start-up, and only folders of processes that no longer run."""
    import os
    import subprocess

    from rollout_service import scratch

    monkeypatch.setattr(scratch, "_scratch_base", lambda: tmp_path)
    proc = subprocess.Popen(["true"])
    proc.wait()
    dead = proc.pid
    (tmp_path / f"rollout-service-{dead}" / "committed").mkdir(parents=True)
    (tmp_path / f"rollout-service-{dead}" / "committed" / "v1.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / f"rollout-service-{os.getppid()}").mkdir()                   # a live process: kept
    (tmp_path / "rollout-service-notapid").mkdir()                           # not ours: kept
    assert scratch.sweep_stale_roots() == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"rollout-service-{os.getppid()}",
                                                                 "rollout-service-notapid"])
    root = scratch.scratch_root()
    assert root.is_dir() and root.name == f"rollout-service-{os.getpid()}"
    scratch.remove_scratch_root()
    assert not root.exists()
