"""A weight service over FakeEngines (no vLLM), shared by the unit tests of commits, staging, the scratch
folder and engine recovery."""

import asyncio

import pytest
import torch
from rollout_client.weights import push_stream
from safetensors.torch import save_file

from rollout_service.api import pb
from tests.fake_engine import FakeEngine
from rollout_service.pool.pool import EnginePool
from rollout_service.weights.service import Chunk, Header, Trailer, WeightService

ORIGINAL = {"a.weight": torch.zeros(4, 3), "b.bias": torch.ones(5, dtype=torch.bfloat16)}


def write_checkpoint(path, tensors=ORIGINAL):
    """A checkpoint directory holding `tensors` (one safetensors file, an empty config)."""
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def make_service(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")

    async def make(engines=2):
        pool = EnginePool([FakeEngine(f"e{i}") for i in range(engines)], max_queue=10, checkpoints={"policy": ckpt})
        await pool.start()
        return pool, WeightService.create(pool, "float32", weights_roots=[str(tmp_path)])
    return make


async def push(svc, weights, version, **kw):
    msgs = list(push_stream(weights, version, target=pb.TARGET_POLICY, chunk_bytes=kw.pop("chunk_bytes", 7),
                             pack_bytes=0, **kw))     # one TensorChunk per message: read as m.chunk below
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


def push_then_crash(start, first, second, point: str) -> None:
    """A server for run_until_killed: `await start()` -> a weight service, `await first(svc)` commits, then with
    ROLLOUT_CRASH_AT=`point` armed `await second(svc)`; exits 3 if the crash point never fired."""
    import os

    async def main():
        svc = await start()
        await first(svc)
        os.environ["ROLLOUT_CRASH_AT"] = point
        await second(svc)
    asyncio.run(main())
    os._exit(3)


def run_until_killed(target, args: tuple, point: str) -> None:
    """Run `target(*args)` in a forked child (a server that arms ROLLOUT_CRASH_AT=`point` itself) and fail unless the
    crash point killed it (SIGKILL); the child's staging folder is removed, as a restarted server's sweep would."""
    import multiprocessing
    import shutil

    from rollout_service import scratch

    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(60)
    shutil.rmtree(scratch._scratch_base() / f"{scratch.ROOT_PREFIX}{child.pid}", ignore_errors=True)
    assert child.exitcode == -9, f"the server was not killed at {point} (exit {child.exitcode})"
