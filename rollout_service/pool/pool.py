"""EnginePool: the data plane's middle, and the owner of its engines and of what they serve. Admission (bounded),
routing (a prompt's whole group to one engine, least-loaded first; a request with a session key to its session's
engine, sessions.py), per-sequence tasks, the bookkeeping GetStatus
reports; the committed versions and weight files (committed.py), the push lock, the operator's pause; and the
engines' lifecycle: starting, restarting and joining at the committed versions, draining and removing an engine,
and marking it unhealthy (the supervisor, the scaler and the weight committer ask the pool)."""
from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import time
from pathlib import Path

import grpc
import msgspec

from rollout_service.engine.base import Engine, EngineGone, EngineState, unless_dead
from rollout_service.engine.types import ADAPTER_WEIGHTS_FILE, SeqRequest
from rollout_service.config import LoraConfig
from rollout_service.errors import ServiceError, refused_by_engine, unavailable
from rollout_service.pool.adapters import AdapterRegistry, AdapterVersion
from rollout_service.pool.committed import CommittedWeights, fingerprint
from rollout_service.pool.fair import FairGate
from rollout_service.pool.partial import Partial
from rollout_service.pool.requests import IndexedResult, RequestRecord, RequestRegistry
from rollout_service.pool.sessions import SessionTable
from rollout_service.pool.telemetry import Telemetry
from rollout_service.scratch import ADAPTER_STAGING, recycle, scratch_root

log = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, engines: list[Engine], *, max_queue: int, idempotency_ttl_s: float = 600.0,
                 checkpoints: dict[str, str | Path | None] | None = None, max_sessions: int = 100_000,
                 session_max_imbalance: int = 32, state_dir: str | Path = "", lora: LoraConfig | None = None,
                 fair_slots: int = 0):
        """checkpoints: target ("policy", "drafter") -> the model directory the engines start from (None or
        absent: the service has no such target, pushes to it are refused). max_sessions, session_max_imbalance:
        session routing (sessions.py; config.SessionConfig). state_dir: where commits survive a restart (empty:
        they do not; committed.py). lora: the LoRA adapters it may serve (adapters.py; None: none). fair_slots: with
        tenants, each engine's slots shared fairly between them (fair.py; 0: no gate, vLLM's first-come order)."""
        if not engines:
            raise ValueError("a pool needs at least one engine")
        self.engines = engines
        self.max_queue = max_queue
        self.requests = RequestRegistry(idempotency_ttl_s)
        self.telemetry = Telemetry()
        self.sessions = SessionTable(max_sessions, session_max_imbalance, on_route=self._session_routed)
        self.depth = 0                                   # sequences admitted and not finished
        self.load = {e.id: 0 for e in engines}           # sequences assigned per engine
        self.finished = {e.id: 0 for e in engines}
        self.closing = False
        self.live: set[RequestRecord] = set()            # unfinished requests, with or without an id
        self.draining: set[str] = set()                  # engines being scaled in: no new work
        self.joining: set[str] = set()                   # engines being scaled out: not ready yet
        # What every serving engine holds: the one record of what the service serves (GetStatus, admission,
        # metrics, restarts). Only the weight committer changes it (record, then label() tells the engines).
        self.committed = CommittedWeights(checkpoints, Path(state_dir) if state_dir else scratch_root() / "committed",
                                          spare_dir=scratch_root(), durable=bool(state_dir))
        self.versions = self.committed.versions
        # LoRA adapters served as policies: their versions loaded on every engine and the sequences on each
        # (durable with a state_dir: state_dir/adapters.json beside committed.json, restored here)
        policy = self.committed.checkpoints.get("policy")
        self.adapters = AdapterRegistry(lora or LoraConfig(), self.committed.state_dir / "adapters",
                                        durable=self.committed.durable,
                                        base=fingerprint(policy) if policy and self.committed.durable else "")
        # Held by every change to what is served (a commit) and to which engines serve (restart, join, leave),
        # so that an engine joins or leaves only between commits and catches up with all of them.
        self.push_lock = asyncio.Lock()
        self.held: str | None = None                     # an operator's pause (HTTP /pause): its in-flight mode
        self.telemetry.patches_of = self.patch_report
        self._unloading: set[asyncio.Task] = set()
        self.fair = FairGate(fair_slots) if fair_slots else None
        self.tenant_load: collections.Counter = collections.Counter()    # sequences admitted per tenant
        self.tenant_samples: collections.Counter = collections.Counter()

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Engines in processes of their own (Ray actors) start together; the others one at a time. Commits a
        previous server recorded in the state_dir are replayed on each before it serves, and the adapter versions
        it recorded loaded."""
        apart = [e for e in self.engines if e.starts_apart]
        together = asyncio.gather(*(e.start() for e in apart))
        try:
            for e in self.engines:
                if not e.starts_apart:
                    await e.start()
        finally:
            await together
        if any(self.committed.restored.values()) or self.adapters.restored:
            async with self.push_lock:
                await self._catch_up(self.engines)
            log.info("restored from %s: policy version %d, drafter version %d, adapters %s", self.committed.state_dir,
                     self.policy_version, self.draft_version,
                     ", ".join(f"{n} {v}" for n, v in sorted(self.adapters.restored.items())) or "none")

    async def _catch_up(self, engines: list[Engine]) -> None:
        """Bring engines started from the checkpoints to the committed versions: replay every committed push
        (policy and drafter, one file per target written once for all of them) and label the versions; each is
        STARTING (not routed to) meanwhile and READY after. Under the push lock."""
        for engine in engines:
            engine.state = EngineState.STARTING
        files = {}
        try:
            for target in ("policy", "drafter"):
                files[target] = await asyncio.to_thread(self.committed.replay_file, target)
            for engine in engines:
                for target, f in files.items():
                    if f is not None:
                        await unless_dead(engine, engine.load_weights(str(f), target))
                await unless_dead(engine, engine.set_versions(self.policy_version, self.draft_version))
                for av in self.adapters.loaded():       # every adapter version the others hold
                    await unless_dead(engine, engine.add_adapter(av.vllm_name, av.lora_id, str(av.path)))
                engine.state = EngineState.READY
        finally:
            for f in files.values():
                if f is not None:
                    f.unlink(missing_ok=True)

    async def shutdown(self) -> None:
        """Fail every unfinished request with UNAVAILABLE, then stop the engines."""
        self.closing = True
        for rec in list(self.live):
            self._fail(rec, unavailable("the server is shutting down; retry the request against a running server"))
        await asyncio.sleep(0)
        for e in self.engines:
            try:
                await e.shutdown()
            except Exception:  # noqa: BLE001 - keep stopping the others
                log.exception("%s: shutdown failed", e.id)

    async def refresh_k_control(self, timeout_s: float = 1.0) -> None:
        """Copy each ready engine's k controller state into telemetry (GetStatus and /metrics read it there):
        every second from the supervisor, and before each GetStatus."""
        ready = [e for e in self.engines if e.state is EngineState.READY]
        snaps = await asyncio.gather(*(asyncio.wait_for(e.k_control_snapshot(), timeout_s) for e in ready),
                                     return_exceptions=True)
        k_control = self.telemetry.k_control
        for e, snap in zip(ready, snaps):
            if isinstance(snap, dict):
                k_control[e.id] = snap
        for gone in set(k_control) - {e.id for e in self.engines}:
            del k_control[gone]

    # ---- engines' lifecycle: the only place (besides the engines themselves) that sets engine.state ---------
    def mark_unhealthy(self, engine: Engine, why: str) -> None:
        """Take `engine` out of service (an engine that failed mid-generate has already said so itself);
        pool.supervisor restarts it."""
        log.error("%s: %s", engine.id, why)
        engine.state = EngineState.UNHEALTHY

    async def restart_at_committed(self, engine: Engine) -> bool:
        """Stop and start `engine` (unhealthy, or new), replay every committed push (policy and drafter) and label
        the versions, and only then route to it: it serves only once it matches the others. Under the push lock,
        so no commit interleaves. False (and UNHEALTHY) if any step failed."""
        async with self.push_lock:
            self._forget_sessions(engine.id, "restarts with an empty prefix cache")
            try:
                await engine.shutdown()
                await engine.start()
                await self._catch_up([engine])        # STARTING (not routed to) until it matches the others
            except Exception:  # noqa: BLE001 - a failed restart leaves the engine out of service, not the server
                log.exception("%s: restart failed; it stays unhealthy", engine.id)
                engine.state = EngineState.UNHEALTHY
                return False
            if self.held is not None:                  # an operator's pause covers it too
                try:
                    await unless_dead(engine, engine.pause(self.held))
                except EngineGone:                     # dead again: the supervisor's next round restarts it
                    engine.state = EngineState.UNHEALTHY
                    return False
            log.info("%s started at policy version %d, drafter version %d", engine.id, self.policy_version,
                     self.draft_version)
            return True

    async def join(self, engine: Engine) -> bool:
        """Scale out: `engine` is listed (status shows it starting) but not routed to while it starts at the
        committed versions; it joins routing once READY, else it is removed and stopped."""
        engine.state = EngineState.STARTING
        self.engines.append(engine)
        self.load.setdefault(engine.id, 0)
        self.finished.setdefault(engine.id, 0)
        self.joining.add(engine.id)
        try:
            await self.restart_at_committed(engine)
        finally:
            self.joining.discard(engine.id)
        if engine.state is not EngineState.READY:
            self.engines.remove(engine)
            await engine.shutdown()
            return False
        return True

    async def retire(self, engine: Engine, *, timeout_s: float) -> None:
        """Scale in: no new work goes to `engine`; once the sequences it holds have finished (or `timeout_s`
        passed) it leaves the pool under the push lock (never mid-commit) and stops."""
        self.draining.add(engine.id)
        log.info("scale in: draining %s (%d sequences)", engine.id, self.load[engine.id])
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while self.load[engine.id] and loop.time() < deadline:
                await asyncio.sleep(0.1)
            async with self.push_lock:
                self.engines.remove(engine)
            self._forget_sessions(engine.id, "left the pool")
            await engine.shutdown()
        finally:
            self.draining.discard(engine.id)

    # ---- the operator's pause ----------------------------------------------------------------------
    async def hold(self, mode: str) -> None:
        """Pause every engine until release() (the HTTP dialects' /pause, /pause_generation). New requests
        queue meanwhile; commits made while held leave the engines paused. Waits for a running commit."""
        async with self.push_lock:
            if self.held is None:
                engines = [e for e in self.engines if e.state is EngineState.READY]
                await asyncio.gather(*(e.pause(mode) for e in engines))
                self.held = mode

    async def release(self) -> None:
        """End hold(): every paused engine generates again (queued and kept sequences continue)."""
        async with self.push_lock:
            if self.held is not None:
                await asyncio.gather(*(e.resume() for e in self.engines if e.state is EngineState.PAUSED))
                self.held = None

    def patch_report(self) -> list[dict]:
        """engine/patches.py's report, as the first engine that has one gives it (every engine runs the same code)."""
        return next((e.patches for e in self.engines if e.patches), [])

    @property
    def ready(self) -> bool:
        return not self.closing and all(e.state is EngineState.READY for e in self.engines
                                        if e.id not in self.joining)

    @property
    def policy_version(self) -> int:
        return self.versions["policy"]

    @property
    def draft_version(self) -> int:
        return self.versions["drafter"]

    async def label(self, engines: list[Engine], **committed: int) -> None:
        """Record newly committed versions (`policy=`, `drafter=`) and label `engines` with them: their samples
        carry them from the next step on. Every serving engine holds the committed versions (a commit lands on
        all of them or on none): its label is a copy, not a vote. Called under the push lock."""
        self.versions.update(committed)
        results = await asyncio.gather(*(unless_dead(e, e.set_versions(self.policy_version, self.draft_version))
                                         for e in engines), return_exceptions=True)
        for err in results:         # one that died meanwhile: the supervisor restarts it at these versions
            if isinstance(err, BaseException) and not isinstance(err, EngineGone):
                raise err

    # ---- data plane ------------------------------------------------------------------------------
    def submit(self, request_id: str, fingerprint: bytes, groups: list[list[SeqRequest]], session: str = "", *,
               partials: list[Partial | None] | None = None, return_partial: bool = False, tenant: str = "",
               quota: int = 0) -> RequestRecord:
        """Admit a request (groups[p] = the samples of prompt p) or return the record it retries. session: its
        session key ("" for none): all of it goes to the session's engine (sessions.py). partials[p]: the partial
        sample prompt p's samples continue (their engine prompts already end with its tokens). return_partial: an
        aborted sample is a result (finish "abort"), not the request's failure. tenant: whose request it is (the
        fair gate's share, `quota`: its most sequences admitted at once, 0: none)."""
        if self.closing:
            raise unavailable("the server is shutting down; retry the request against a running server")
        existing = self.requests.get(request_id) if request_id else None
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"request_id {request_id!r} was already used for a different request; "
                                   "use a new request_id for new work")
            return existing
        count = sum(len(g) for g in groups)
        if self.depth + count > self.max_queue:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"queue full: {self.depth} sequences admitted, this request adds {count}, "
                               f"max_queue is {self.max_queue}; retry later with backoff or send fewer prompts")
        if quota and self.tenant_load[tenant] + count > quota:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"tenant {tenant!r}: {self.tenant_load[tenant]} sequences admitted, this request adds "
                               f"{count}, its quota (security.tenants max_sequences) is {quota}; retry later with "
                               "backoff or send fewer prompts")
        # A paused engine (a weight commit in progress) queues new sequences until it resumes.
        ready = [e for e in self.engines
                 if e.state in (EngineState.READY, EngineState.PAUSED) and e.id not in self.draining]
        if not ready:
            raise unavailable("no engine is ready to serve (starting or unhealthy); retry shortly")
        rec = RequestRecord(request_id=request_id, fingerprint=fingerprint, expected=count,
                            return_partial=return_partial)
        admitted = time.monotonic()
        home = self.sessions.route(session, ready, self.load) if session else None
        for p, group in enumerate(groups):
            engine = home or min(ready, key=lambda e: self.load[e.id])   # the whole group on one engine
            self.load[engine.id] += len(group)
            for s, seq in enumerate(group):
                self.depth += 1
                slot = _Slot(engine.id, seq.lora_id, tenant)
                self.tenant_load[tenant] += 1
                if seq.lora_id:
                    self.adapters.hold(seq.lora_id)       # its version stays loaded until the sequence ends
                task = asyncio.create_task(self._run(rec, engine, p, s, seq, admitted, slot,
                                                     partials[p] if partials else None))
                # also on completion: a task cancelled before it ever ran still releases its slot
                task.add_done_callback(lambda _t, sl=slot: self._release(sl))
                rec.tasks.append(task)
        self.telemetry.m_queue.set(self.depth)
        self.live.add(rec)
        if request_id:
            self.requests.put(rec)
        return rec

    def _session_routed(self, outcome: str) -> None:
        self.telemetry.session_routed(outcome, len(self.sessions))

    def _forget_sessions(self, engine_id: str, why: str) -> None:
        forgotten = self.sessions.forget_engine(engine_id)
        if forgotten:
            log.info("%s %s: forgot its %d session(s); their next requests route least-loaded", engine_id, why,
                     forgotten)
            self.telemetry.m_sessions.set(len(self.sessions))

    def _release(self, slot: "_Slot") -> None:
        if slot.released:
            return
        slot.released = True
        self.tenant_load[slot.tenant] -= 1
        self.depth -= 1
        self.load[slot.engine_id] -= 1
        self.telemetry.m_queue.set(self.depth)
        if slot.lora_id:
            done = self.adapters.release(slot.lora_id)
            if done is not None:                          # retired and nothing runs on it any more
                task = asyncio.get_running_loop().create_task(self.unload_adapters([done]))
                self._unloading.add(task)
                task.add_done_callback(self._unloading.discard)

    async def unload_adapters(self, versions: list[AdapterVersion]) -> None:
        """Unload adapter versions nothing runs on any more from every engine, then delete their files. Under the
        push lock (no engine joins or restarts meanwhile). An engine that fails to unload one keeps it loaded
        (vLLM's LRU cache bounds what it holds); nothing is served from it again."""
        async with self.push_lock:
            for av in versions:
                results = await asyncio.gather(*(unless_dead(e, e.remove_adapter(av.lora_id)) for e in self.engines
                                                 if e.state in (EngineState.READY, EngineState.PAUSED)),
                                               return_exceptions=True)
                for err in results:
                    if isinstance(err, BaseException):
                        log.warning("unloading adapter %s: %s", av.vllm_name, err)
                self.adapters.forget(av)
                await asyncio.to_thread(_drop_adapter_files, av.path)
                log.info("adapter %s version %d unloaded", av.name, av.version)

    async def _run(self, rec: RequestRecord, engine: Engine, p: int, s: int, seq: SeqRequest,
                   admitted: float, slot: "_Slot", partial: Partial | None = None) -> None:
        def on_delta(d):
            if seq.lora_id:                    # an adapter sample runs on one adapter version throughout
                d = msgspec.structs.replace(d, version_spans=[(seq.adapter_version, d.start)])
            rec.add_delta(p, s, partial.shifted(d) if partial else d)

        gate = self.fair
        try:
            if gate is not None:
                await gate.acquire(engine.id, slot.tenant)       # a fair share of the engine's batch
            try:
                if seq.stream:
                    result = await engine.generate(seq, on_delta)
                else:
                    result = await engine.generate(seq)
            finally:
                if gate is not None and slot.tenant in gate.running[engine.id]:
                    gate.release(engine.id, slot.tenant)
        except ServiceError as e:
            self._fail(rec, e)
            return
        except Exception as e:  # noqa: BLE001 - an engine failure fails this request, not the server
            refused = refused_by_engine(e)       # the request's fault: INVALID_ARGUMENT, never "retry"
            if refused is not None:
                log.warning("%s refused %s: %s", engine.id, seq.seq_id, e)
                self._fail(rec, refused)
                return
            log.exception("%s failed on %s", engine.id, seq.seq_id)
            self._fail(rec, unavailable(f"engine {engine.id} failed while generating ({type(e).__name__}: {e}); "
                                        "retry the request"))
            return
        finally:
            self._release(slot)
        if result.finish_reason == "abort" and not rec.return_partial:
            self._fail(rec, ServiceError(grpc.StatusCode.ABORTED,
                                         f"generation was aborted on {engine.id} (a weight push in abort mode "
                                         "committed new weights); retry the request"))
            return
        self.finished[engine.id] += 1
        self.tenant_samples[slot.tenant] += 1
        if seq.lora_id:
            self.adapters.finished(seq.lora_id, len(result.token_ids), result.num_drafted, result.num_accepted)
        self.telemetry.sample_finished(len(result.token_ids), result.finish_reason, time.monotonic() - admitted,
                                       result.policy_version, result.draft_version,
                                       result.num_drafted, result.num_accepted, result.spec_steps,
                                       result.accepted_per_pos)
        if seq.lora_id:                        # the adapter's version line, not the base policy's
            result = msgspec.structs.replace(result, policy_version=seq.adapter_version,
                                             version_spans=[(seq.adapter_version, 0)])
        rec.add(IndexedResult(p, s, partial.joined(result) if partial else result))
        if len(rec.results) == rec.expected:
            rec.finish()
            self.live.discard(rec)

    def _fail(self, rec: RequestRecord, error: ServiceError) -> None:
        rec.finish(error)
        rec.cancel()
        self.live.discard(rec)
        if rec.request_id:
            self.requests.drop(rec.request_id)     # a retry with the same id runs the request again

    def attach(self, rec: RequestRecord) -> None:
        rec.readers += 1

    def detach(self, rec: RequestRecord) -> None:
        """A reader left. The last reader leaving an unfinished request aborts its sequences."""
        rec.readers -= 1
        if rec.readers == 0 and not rec.done:
            self._fail(rec, ServiceError(grpc.StatusCode.CANCELLED, "cancelled by the client"))


class _Slot:
    """One admitted sequence's place in the queue and on its engine; released exactly once."""

    __slots__ = ("engine_id", "released", "lora_id", "tenant")

    def __init__(self, engine_id: str, lora_id: int = 0, tenant: str = ""):
        self.engine_id = engine_id
        self.released = False
        self.lora_id = lora_id
        self.tenant = tenant


def _drop_adapter_files(folder: Path) -> None:
    """Delete an unloaded adapter version's PEFT directory, its weights file kept as the next adapter push's staging
    file (scratch.recycle), whose pages stay allocated: a rank-8 adapter written into fresh pages took ~10 ms of page
    faults more. Only once every engine removed the version: vLLM's add_lora may keep the tensors safetensors maps from
    the file (not copies), so the file of a version an engine holds is never written. An engine whose removal failed
    may still map it, but nothing is served from that version again. Blocking: in a thread."""
    recycle(folder / ADAPTER_WEIGHTS_FILE, scratch_root() / ADAPTER_STAGING)
    shutil.rmtree(folder, ignore_errors=True)
