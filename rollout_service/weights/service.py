"""Weight pushes end to end: header checks, staging, validation, commit; timings for the reply."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from rollout_service.errors import Name, ServiceError, invalid, invalid_field
from rollout_service.scratch import recycle
from rollout_service.weights.adapter_commit import AdapterCommitter
from rollout_service.weights.adapters import (CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, AdapterSpec, check_size,
                                              parse_config)
from rollout_service.validation import name_problem
from rollout_service.weights.committer import WeightCommitter
from rollout_service.weights.delta import Delta, DeltaStager, materialize, read_delta_files
from rollout_service.weights.manifest import Manifest, read_headers, read_manifest
from rollout_service.weights.paths import open_regular, resolve_roots, weight_files
from rollout_service.weights.shield import run_to_end
from rollout_service.scratch import ADAPTER_STAGING, scratch_root
from rollout_service.weights.staging import Stager

log = logging.getLogger(__name__)
# LoadWeights' directory listings and header reads: threads of their own, so reads stuck on a stalled
# filesystem can neither hold the event loop nor take the default executor's threads from pushes.
FILE_IO = ThreadPoolExecutor(max_workers=4, thread_name_prefix="load-weights-io")
# A push's chunks are checked, hashed and copied into the staging file in a thread, in order, at most this many bytes
# (or chunks) at a time; the next ones are received meanwhile.
BATCH_BYTES = 1 << 20
BATCH_CHUNKS = 256
SPECS_KEPT = 16        # adapter configs kept parsed (with their tensors' manifest and staging layout)


def _add_all(stager, chunks: list) -> None:
    for c in chunks:
        stager.add(c.name, c.dtype, c.shape, c.offset, c.data, c.indices)


@dataclass
class PushOutcome:
    version: int
    target: str
    num_tensors: int
    num_bytes: int
    partial: bool
    receive_s: float
    validate_s: float
    apply_s: float
    pause_s: float
    total_s: float
    prepare_s: float
    adapter: str = ""      # target "adapter": its name
    base_version: int = 0  # a delta's base (0: a full push)
    fingerprint: str = ""  # the target's committed values (fingerprint.py)


@dataclass
class Header:
    version: int
    target: str            # "policy" | "drafter" | "adapter"
    total_bytes: int
    sha256: str
    mode: str              # "abort" | "wait" | "keep"
    partial: bool
    adapter: str = ""          # target "adapter": its name
    adapter_config: str = ""   # target "adapter": PEFT's adapter_config.json
    base_version: int = 0      # nonzero: a delta against this version (weights/delta.py)


@dataclass
class Chunk:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    data: bytes
    indices: bytes = b""       # a delta's sparse chunk: uint32 flat indices of `data`'s values


@dataclass
class Trailer:
    """The stream's last item when the header left sha256 empty."""
    sha256: str


def _check_sha256(value: str, where: str) -> None:
    if len(value) != 64 or any(c not in "0123456789abcdefABCDEF" for c in value):
        raise invalid_field(f"{where}.sha256", "must be 64 hex characters (sha256 of all chunk data in stream order)",
                            sep=" ")


class WeightService:
    def __init__(self, committer: WeightCommitter, manifests: dict[str, Manifest], weights_roots: list[str]):
        self.committer = committer
        self.manifests = manifests
        self.roots = resolve_roots(weights_roots)     # LoadWeights reads only below these
        self.adapters = AdapterCommitter(committer.pool)
        self._specs: dict[tuple, AdapterSpec] = {}     # accepted adapter configs, parsed (adapter_spec)

    @classmethod
    def create(cls, pool, serving_dtype: str, *, weights_roots: list[str],
               quantized: frozenset[str] = frozenset()) -> "WeightService":
        """Pushes to the targets the pool was given checkpoints for, validated against their manifests. `quantized`:
        the targets served quantized, which take any float dtype (the engines quantize what arrives)."""
        manifests = {t: read_manifest(str(ckpt), serving_dtype, t in quantized)
                     for t, ckpt in pool.committed.checkpoints.items() if ckpt is not None}
        return cls(WeightCommitter(pool), manifests, weights_roots)

    def _check_header(self, h: Header) -> None:
        if h.version <= 0:
            raise invalid_field("header.version", f"must be > 0, got {h.version}", sep=" ")
        self.committer.check_version(h.target, h.version)
        if h.base_version < 0:
            raise invalid_field("header.base_version", f"must be >= 0 (0: a full push), got {h.base_version}", sep=" ")
        if h.base_version:
            self.committer.check_base(h.target, h.base_version)
        if h.sha256:                    # empty: it comes in the trailer
            _check_sha256(h.sha256, "header")

    def adapter_spec(self, name: str, version: int, config: str | bytes, where: str, rpc: str = "") -> AdapterSpec:
        """An adapter push's name, version and PEFT config checked against the served model and the limits."""
        problem = name_problem(name)
        if problem:
            raise invalid_field(f"{where}adapter", problem, rpc=rpc)
        if name == self.committer.pool.committed.checkpoints["policy"].name:
            raise invalid_field(f"{where}adapter", f"{name!r} is the base model's name; name the adapter otherwise",
                                rpc=rpc)
        if version <= 0:
            raise invalid_field(f"{where}version", f"must be > 0, got {version}", sep=" ", rpc=rpc)
        registry = self.committer.pool.adapters
        registry.check_push(name, version, where)
        lora = registry.cfg
        key = (config, lora.max_rank)
        spec = self._specs.get(key)            # a trainer pushes the same config every step: parsed once
        if spec is None:
            spec = parse_config(config, self.manifests["policy"], lora.max_rank, f"{where}adapter_config", rpc)
            self._specs[key] = spec
            while len(self._specs) > SPECS_KEPT:
                self._specs.pop(next(iter(self._specs)))
        check_size(spec.num_bytes, lora.max_adapter_mb, f"{rpc or 'push'}: adapter {name!r}")
        return spec

    async def push(self, header: Header, chunks: AsyncIterator[Chunk | list[Chunk] | Trailer],
                   tenant: str = "") -> PushOutcome:
        """chunks: the stream after the header, a Chunk per TensorChunk message or a list of them per TensorBatch
        (each checked as a chunk of its own, in order), then the Trailer if the header had no sha256."""
        t0 = time.perf_counter()
        spec = None
        if header.target == "adapter":
            if header.base_version:
                raise invalid_field("header.base_version", "is for policy and drafter pushes; an adapter is pushed "
                                    "whole", sep=" ")
            if header.partial:
                raise invalid_field("header.partial", "an adapter push carries the whole adapter; leave it false",
                                    sep=" ")
            spec = self.adapter_spec(header.adapter, header.version, header.adapter_config, "header.")
            if header.sha256:
                _check_sha256(header.sha256, "header")
        else:
            self._check_header(header)
        manifest = spec.manifest if spec is not None else self.manifests[header.target]
        if header.base_version:
            return await self._push_delta(header, chunks, manifest, t0)
        # cancelled while the file is made, the thread goes on and its file is given up when it is done
        # an adapter stages apart: a full push's spare file (scratch.recycle) stays for the next full push
        folder = scratch_root() if spec is None else scratch_root() / ADAPTER_STAGING
        stager = await run_to_end(asyncio.to_thread(Stager, manifest, header.total_bytes,
                                                    header.sha256, header.partial, folder),
                                  "staging start",
                                  orphaned=lambda st: asyncio.get_running_loop().run_in_executor(None, st.discard))
        await self._receive(stager, header, chunks)
        staged = await run_to_end(asyncio.to_thread(stager.finish), "staging write",
                                  orphaned=lambda st: st.discard())
        if spec is not None:                 # moved into the adapter's directory, or recycled here if that failed
            try:
                res = await self.adapters.commit(header.adapter, header.version, spec, staged.path,
                                                 staged.num_bytes, tenant, keep_file=False)
            finally:
                recycle(staged.path, self.committer.committed.spare_dir)
            return PushOutcome(res.version, "adapter", len(staged.names), staged.num_bytes, False, staged.receive_s,
                               staged.validate_s, res.apply_s, 0.0, time.perf_counter() - t0, 0.0,
                               adapter=header.adapter)
        # The committer owns the staged file from here: it keeps it on success and recycles it otherwise.
        res = await self.committer.commit([staged.path], staged.names, header.version, header.target,
                                          header.mode, keep_files=False)
        return PushOutcome(res.version, header.target, len(staged.names), staged.num_bytes, staged.partial,
                           staged.receive_s, staged.validate_s, res.apply_s, res.pause_s, time.perf_counter() - t0,
                           res.prepare_s, fingerprint=res.fingerprint)

    async def _push_delta(self, header: Header, chunks, manifest: Manifest, t0: float) -> PushOutcome:
        """A delta push: received into memory (a delta is small), then made whole against its base and committed under
        the push lock (weights/delta.py)."""
        stager = DeltaStager(manifest, header.total_bytes, header.sha256)
        await self._receive(stager, header, chunks)
        delta = await asyncio.to_thread(stager.finish)
        return await self._commit_delta(delta, header.version, header.target, header.mode, header.base_version,
                                        manifest, t0)

    async def _commit_delta(self, delta: Delta, version: int, target: str, mode: str, base_version: int,
                            manifest: Manifest, t0: float) -> PushOutcome:
        partial = bool(set(manifest.tensors) - set(delta.entries))
        sparse = [n for n, e in delta.entries.items() if e.sparse]

        def whole(committed):
            return materialize(delta, committed.sources(sparse, target), scratch_root(), committed.spare_dir, partial)

        res = await self.committer.commit([], [], version, target, mode, keep_files=False,
                                          base_version=base_version, delta=whole)
        log.info("delta %d -> %d of %s: %d tensors, %d elements set, %d bytes, made whole in %.3f s", base_version,
                 version, target, len(delta.entries), delta.changed, delta.num_bytes, res.materialize_s)
        return PushOutcome(res.version, target, len(delta.entries), delta.num_bytes, partial, delta.receive_s,
                           delta.validate_s + res.materialize_s, res.apply_s, res.pause_s, time.perf_counter() - t0,
                           res.prepare_s, base_version=base_version, fingerprint=res.fingerprint)

    async def _receive(self, stager, header: Header, chunks) -> None:
        """Feed the stream's chunks to `stager` (Stager or DeltaStager), in order; on any failure the stager is
        discarded (its file becomes the spare)."""
        # Hashing and copying into the staging file run in a thread (hashlib and the copies release the GIL),
        # so Generate streams keep flowing on the event loop while a large push arrives. Pipelined: the next
        # chunk is received while the thread checks, hashes and copies the previous one (in order).
        # Chunks that arrive while the thread copies the previous ones go to it together (up to BATCH_BYTES): one
        # thread hop per chunk cost more than the copies of an adapter's ~400 small tensors (its receive took
        # 0.12-0.24 s for 9.8 MB). A chunk that finds the thread idle goes at once.
        adding: asyncio.Future | None = None
        batch: list[Chunk] = []
        batched = 0

        async def hand_over():
            nonlocal adding, batch, batched
            if adding is not None:
                await adding
            adding = asyncio.ensure_future(asyncio.to_thread(_add_all, stager, batch)) if batch else None
            batch, batched = [], 0

        try:
            async for c in chunks:
                if isinstance(c, Trailer):
                    if header.sha256:
                        raise invalid("the sha256 came twice (header and trailer); send it in exactly one")
                    _check_sha256(c.sha256, "trailer")
                    stager.sha256 = c.sha256
                    continue
                if isinstance(c, list):          # a TensorBatch message's chunks, in order
                    batch.extend(c)
                    batched += sum(len(x.data) + len(x.indices) for x in c)
                else:
                    batch.append(c)
                    batched += len(c.data) + len(c.indices)
                if adding is None or adding.done() or batched >= BATCH_BYTES or len(batch) >= BATCH_CHUNKS:
                    await hand_over()
            await hand_over()
            if adding is not None:
                await adding
            if not stager.sha256:
                raise invalid(("no sha256: set ", Name("header.sha256"), ", or end the stream with a trailer "
                               "carrying it"))
        except BaseException:
            async def clean_up():        # stream cut, bad chunk or cancelled: let the copy finish, then free the file
                if adding is not None:
                    await asyncio.gather(adding, return_exceptions=True)
                await asyncio.to_thread(stager.discard)
            # one shielded unit: a second cancellation (gRPC's, after the cut stream's own error) landing while
            # the copy finished used to skip the discard and leave the file in /dev/shm (CI, 2026-11-26)
            await run_to_end(clean_up(), "staging cleanup")
            raise

    async def load(self, path: str, version: int, target: str, mode: str, partial: bool,
                   timeout: float | None = None, adapter: str = "", tenant: str = "",
                   base_version: int = 0) -> PushOutcome:
        """LoadWeights: validate the files' headers against the model, then commit them in place.
        timeout: the request's remaining deadline (s) for reading the files; None waits as long as the caller.
        target "adapter": `path` is a PEFT adapter directory, committed as version `version` of `adapter`.
        base_version: the files hold a delta against that version (weights/delta.py)."""
        t0 = time.perf_counter()
        if target == "adapter":
            if base_version:
                raise invalid_field("base_version", "is for policy and drafter loads; an adapter is loaded whole",
                                    sep=" ", rpc="LoadWeights")
            return await self._load_adapter(path, version, adapter, partial, timeout, tenant, t0)
        if version <= 0:
            raise invalid_field("version", f"must be > 0, got {version}", sep=" ")
        self.committer.check_version(target, version)
        if base_version < 0:
            raise invalid_field("base_version", f"must be >= 0 (0: whole tensors), got {base_version}", sep=" ",
                                rpc="LoadWeights")
        if base_version:
            self.committer.check_base(target, base_version, "base_version")
            manifest = self.manifests[target]

            def read():
                files, headers, _ = self._read(path)
                return read_delta_files(headers, files, manifest, f"{path}: ")
            try:
                delta = await asyncio.wait_for(asyncio.wrap_future(FILE_IO.submit(read)), timeout)
            except TimeoutError:
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"LoadWeights: reading {path!r} outlasted the request's deadline; nothing changed"
                                   ) from None
            delta.receive_s = time.perf_counter() - t0 - delta.validate_s
            return await self._commit_delta(delta, version, target, mode, base_version, manifest, t0)
        # Listing and reading may block (a stalled shared filesystem): in FILE_IO's threads, under the
        # deadline. Cancelled or timed out here, no lock was taken and nothing changed; a stuck read only
        # keeps its own thread.
        try:
            files, headers, t_val = await asyncio.wait_for(
                asyncio.wrap_future(FILE_IO.submit(self._read, path)), timeout)
        except TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"LoadWeights: reading {path!r} outlasted the request's deadline ({timeout:.1f} s "
                               "left); is its filesystem stalled? Nothing was changed") from None
        manifest = self.manifests[target]
        names, nbytes = [], 0
        for name, (found, size) in headers.items():
            if manifest.check_tensor(name, found.dtype, found.shape, where=f"{path}: "):
                names.append(name)
                nbytes += size
        missing = manifest.check_complete(names, partial, where=f"{path}: ")
        validate_s = time.perf_counter() - t_val
        res = await self.committer.commit(files, names, version, target, mode, keep_files=True)
        return PushOutcome(res.version, target, len(names), nbytes, missing, t_val - t0, validate_s,
                           res.apply_s, res.pause_s, time.perf_counter() - t0, res.prepare_s,
                           fingerprint=res.fingerprint)

    async def _load_adapter(self, path, version, name, partial, timeout, tenant, t0) -> PushOutcome:
        if partial:
            raise invalid_field("partial", "an adapter is loaded whole; leave it false", sep=" ", rpc="LoadWeights")
        problem = name_problem(name)
        if problem:
            raise invalid_field("adapter", problem, rpc="LoadWeights")
        try:
            files, headers, config, t_val = await asyncio.wait_for(
                asyncio.wrap_future(FILE_IO.submit(self._read_adapter, path)), timeout)
        except TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"LoadWeights: reading {path!r} outlasted the request's deadline; nothing changed"
                               ) from None
        spec = self.adapter_spec(name, version, config, "", "LoadWeights")
        nbytes = 0
        for tname, (found, size) in headers.items():
            spec.manifest.check_tensor(tname, found.dtype, found.shape, where=f"{files[0]}: ")
            nbytes += size
        spec.manifest.check_complete(list(headers), False, where=f"{files[0]}: ")
        validate_s = time.perf_counter() - t_val
        res = await self.adapters.commit(name, version, spec, files[0], nbytes, tenant, keep_file=True)
        return PushOutcome(res.version, "adapter", len(headers), nbytes, False, t_val - t0, validate_s, res.apply_s,
                           0.0, time.perf_counter() - t0, 0.0, adapter=name)

    def _read_adapter(self, path: str):
        """(files, headers, config text, time the reads began) of a PEFT adapter directory below the weights roots:
        its adapter_model.safetensors and adapter_config.json. Blocking: runs in FILE_IO."""
        files = [f for f in weight_files(path, self.roots) if f.name == WEIGHTS_FILE]
        if not files:
            raise invalid_field("path", f"{path!r} is not a PEFT adapter directory (no {WEIGHTS_FILE})", sep=" ",
                                rpc="LoadWeights")
        t_val = time.perf_counter()
        try:
            with open_regular(files[0].parent / CONFIG_FILE) as fh:
                config = fh.read(MAX_CONFIG_BYTES + 1)
            return files, read_headers(files), config, t_val
        except (OSError, ValueError) as e:      # unreadable, not safetensors, no config
            raise invalid_field("path", f"{path!r}: {e}", sep=" ", rpc="LoadWeights") from None

    def _read(self, path: str):
        """(files, headers, time the reads began): the regular safetensors files `path` names inside the
        weights roots, and their headers. Blocking: runs in FILE_IO."""
        files = weight_files(path, self.roots)
        t_val = time.perf_counter()
        try:
            return files, read_headers(files), t_val
        except (OSError, ValueError) as e:      # unreadable, not safetensors
            raise invalid_field("path", f"{path!r}: {e}", sep=" ", rpc="LoadWeights") from None
