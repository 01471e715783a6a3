"""Staging a push: checksums, sizes, chunk bounds and the staged file's safetensors format (no engine)."""
import asyncio
import hashlib

import pytest
import torch

from rollout_service.errors import ServiceError
from rollout_service.weights.service import Chunk, Header, Trailer


def test_checksum_and_size_are_checked(make_service):
    async def main():
        pool, svc = await make_service()
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



def test_checksum_in_the_trailer(make_service):
    """The sha256 may come last (the client hashes while it streams): exactly one of header and trailer
    carries it, a wrong one fails like a wrong header checksum, and none at all is refused."""
    async def main():
        pool, svc = await make_service()
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
