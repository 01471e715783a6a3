"""The LoRA adapters the pool serves as policies: each name's version line, the versions loaded on every engine,
the sequences running on each, and what is served per adapter (GetStatus).

Every loaded version is one vLLM LoRA (a LoRARequest with an id unique in this server's life and the version's PEFT
directory). A commit (weights/adapter_commit.py) adds the new version on every engine, then records it here; the
versions beyond `versions_kept` are then unloaded, each once the sequences running on it have finished (release()
says when), so a sample in flight always finishes on the version it started on. Requests resolve a name (and an
optional version) to a loaded version at admission (resolve()) and hold it until their sequence ends.

Durable (a configured state_dir): what is served (each name's tenant, latest version and the versions kept loaded,
with their PEFT directories under state_dir/adapters/) is also recorded in `state_dir/adapters.json`, written
atomically (a new file, fsynced, renamed over the old one) after the new version's files are in place and fsynced,
and before any file the previous record names is removed. A commit or an unload is durable once the record is
renamed: a server killed before serves the old versions after a restart, one killed after the new ones. A restarted
server (a new process on the same state_dir) loads every recorded version on every engine before it serves, under the
same names and versions (new vLLM LoRA ids). Without a state_dir the directories live in the process's scratch folder
and a restarted server serves no adapter.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rollout_service.config import ConfigError, LoraConfig
from rollout_service.durable import write_json_atomically
from rollout_service.errors import ServiceError, about_field

log = logging.getLogger(__name__)
RECORD = "adapters.json"          # in the state_dir, beside committed.json
FORMAT = 1


class AdapterStateMismatch(ConfigError):
    """The state_dir's adapters cannot be served by this server (another base model, LoRA off, lower limits)."""


@dataclass
class AdapterVersion:
    name: str
    version: int
    lora_id: int                  # vLLM's lora_int_id (unique in this server's life)
    path: Path                    # the PEFT directory every engine loads
    rank: int
    num_bytes: int
    modules: list[str]            # target module names (q_proj, ...)
    running: int = 0              # sequences admitted on it and not finished
    retired: bool = False         # beyond versions_kept (or unloaded): no new request; unloaded once running is 0

    @property
    def vllm_name(self) -> str:
        return f"{self.name}@v{self.version}"


@dataclass
class Adapter:
    name: str
    tenant: str = ""              # who pushed it ("": the admin token)
    versions: dict[int, AdapterVersion] = field(default_factory=dict)   # loaded, oldest first
    latest: int = 0               # the newest committed version (0: none yet)
    unloading: bool = False       # UnloadAdapter: no new request, gone once its sequences finish
    samples_total: int = 0
    tokens_total: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def running(self) -> int:
        return sum(v.running for v in self.versions.values())


class AdapterRegistry:
    def __init__(self, cfg: LoraConfig, root: Path, *, durable: bool = False, base: str = ""):
        """root: the PEFT directories (root/<name>/v<version>/); durable: root is state_dir/adapters and the record
        state_dir/adapters.json (root's parent) survives a restart; base: the base checkpoint's fingerprint
        (committed.fingerprint), recorded so that adapters are never restored over another base model."""
        self.cfg = cfg
        self.root = root
        self.durable = durable
        self.record_path = root.parent / RECORD
        self.base = base
        self.adapters: dict[str, Adapter] = {}
        self.by_id: dict[int, AdapterVersion] = {}
        self.next_id = 1
        self.restored: dict[str, list[int]] = {}      # name -> the versions read back from the state_dir
        if durable:
            self._restore()
        else:
            shutil.rmtree(root, ignore_errors=True)   # not kept across restarts: a previous server's files

    @property
    def enabled(self) -> bool:
        return self.cfg.max_adapters > 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def folder(self, name: str, version: int) -> Path:
        return self.root / name / f"v{version}"

    # ---- control plane ------------------------------------------------------------------------------
    def check_push(self, name: str, version: int, field_prefix: str) -> None:
        """Raise unless `version` of `name` may be committed: LoRA on, a free slot for a new name, a newer version."""
        if not self.enabled:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this server serves no LoRA adapters (engine.lora.max_adapters is 0); restart it "
                               "with --max-adapters N")
        a = self.adapters.get(name)
        if a is None or a.unloading:
            live = sum(1 for x in self.adapters.values() if not x.unloading)
            if live >= self.cfg.max_adapters:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{field_prefix}adapter: {name!r} would be adapter {live + 1}, above the "
                                   f"server's engine.lora.max_adapters={self.cfg.max_adapters}; unload one "
                                   "(UnloadAdapter, /v1/unload_lora_adapter) or raise --max-adapters")
        if a is not None and version <= a.latest:
            raise about_field(grpc.StatusCode.FAILED_PRECONDITION, f"{field_prefix}version",
                              f"adapter {name!r} version {version} is not newer than its latest version {a.latest}; "
                              "versions must strictly increase per adapter", sep=" ")

    def record(self, av: AdapterVersion, tenant: str) -> list[AdapterVersion]:
        """`av` committed on every engine: it is the name's latest. Returns the versions to unload now (beyond
        versions_kept with nothing running on them); those with sequences running are retired and unloaded when
        release() says so."""
        a = self.adapters.get(av.name)
        if a is None or a.unloading:
            old = a
            a = self.adapters[av.name] = Adapter(av.name, tenant)
            if old is not None:               # an unload still draining: its versions stay until they finish
                a.versions.update(old.versions)
        a.versions[av.version] = av
        a.latest = av.version
        self.by_id[av.lora_id] = av
        live = [v for v in a.versions.values() if not v.retired]
        drop = []
        for v in sorted(live, key=lambda v: v.version)[:-self.cfg.versions_kept]:
            v.retired = True
            if v.running == 0:
                drop.append(v)
        return drop

    def unload(self, name: str) -> tuple[Adapter, list[AdapterVersion]]:
        """UnloadAdapter: no new request may name it; returns it and the versions to unload now (the rest when
        their sequences finish)."""
        self.check_unload(name)
        a = self.adapters[name]
        a.unloading = True
        drop = []
        for v in a.versions.values():
            v.retired = True
            if v.running == 0:
                drop.append(v)
        return a, drop

    def check_unload(self, name: str) -> None:
        """NOT_FOUND naming `name` unless it is served (UnloadAdapter)."""
        a = self.adapters.get(name)
        if a is None or a.unloading:
            raise about_field(grpc.StatusCode.NOT_FOUND, "name", f"no adapter {name!r} is served"
                              + (f" (served: {', '.join(sorted(self.served()))})" if self.served() else ""), sep=": ")

    def forget(self, av: AdapterVersion) -> None:
        """`av` was unloaded from every engine."""
        self.by_id.pop(av.lora_id, None)
        a = self.adapters.get(av.name)
        if a is not None:
            a.versions.pop(av.version, None)
            if a.unloading and not a.versions:
                del self.adapters[av.name]

    def loaded(self) -> list[AdapterVersion]:
        """Every version every engine must hold (an engine that restarts or joins loads them all)."""
        return list(self.by_id.values())

    def served(self) -> list[str]:
        return [n for n, a in self.adapters.items() if not a.unloading and a.latest]

    # ---- data plane ---------------------------------------------------------------------------------
    def resolve(self, name: str, version: int) -> AdapterVersion:
        """The loaded version a request naming `name` (and `version`, 0: the latest) runs on; NOT_FOUND for an
        unknown, unloaded or evicted one, FAILED_PRECONDITION for a version never pushed."""
        a = self.adapters.get(name)
        if a is None or a.unloading or not a.latest:
            served = self.served()
            raise about_field(grpc.StatusCode.NOT_FOUND, "policy",
                              f"no adapter {name!r} is served ("
                              + (f"served: {', '.join(sorted(served))}" if served else "none is served")
                              + "); push it first (PushWeights with TARGET_ADAPTER, /v1/load_lora_adapter), or "
                              "leave policy empty for the base policy")
        if not version:
            return a.versions[a.latest]
        if version > a.latest:
            raise about_field(grpc.StatusCode.FAILED_PRECONDITION, "policy_version",
                              f"adapter {name!r} has no version {version} yet (latest: {a.latest})", sep=": ")
        v = a.versions.get(version)
        if v is None or v.retired:
            kept = sorted(x.version for x in a.versions.values() if not x.retired)
            raise about_field(grpc.StatusCode.NOT_FOUND, "policy_version",
                              f"adapter {name!r} version {version} was evicted (the server keeps the last "
                              f"{self.cfg.versions_kept}: {kept}); sample a loaded version or the latest", sep=": ")
        return v

    def hold(self, lora_id: int) -> None:
        self.by_id[lora_id].running += 1

    def release(self, lora_id: int) -> AdapterVersion | None:
        """A sequence on `lora_id` ended. Returns its version when it is retired and nothing runs on it any more
        (the caller unloads it)."""
        v = self.by_id.get(lora_id)
        if v is None:
            return None
        v.running -= 1
        return v if v.retired and v.running == 0 else None

    def finished(self, lora_id: int, tokens: int, drafted: int, accepted: int) -> None:
        v = self.by_id.get(lora_id)
        a = self.adapters.get(v.name) if v is not None else None
        if a is not None:
            a.samples_total += 1
            a.tokens_total += tokens
            a.num_drafted += drafted
            a.num_accepted += accepted

    # ---- the durable record (state_dir/adapters.json) ----------------------------------------------------
    def snapshot(self, add: AdapterVersion | None = None, tenant: str = "", without: str = "") -> dict:
        """The record of what is served, as it will be once `add` is recorded (record(add, tenant)) or `without`
        unloaded: each name's tenant, latest version and the versions kept loaded (not retired). Read on the event
        loop; written by save() in a thread."""
        def entry(v: AdapterVersion) -> dict:
            return {"version": v.version, "path": str(v.path.relative_to(self.root)), "rank": v.rank,
                    "num_bytes": v.num_bytes, "modules": list(v.modules)}

        names = {}
        for name, a in self.adapters.items():
            if a.unloading or not a.latest or name == without:
                continue
            live = sorted((v for v in a.versions.values() if not v.retired), key=lambda v: v.version)
            names[name] = {"tenant": a.tenant, "latest": a.latest, "versions": [entry(v) for v in live]}
        if add is not None:
            rec = names.setdefault(add.name, {"tenant": tenant, "latest": 0, "versions": []})
            rec["latest"] = add.version
            rec["versions"] = (rec["versions"] + [entry(add)])[-self.cfg.versions_kept:]
        return {"format": FORMAT, "base": self.base, "adapters": names}

    def save(self, record: dict) -> None:
        """Write `record` (snapshot()) atomically: a new file, fsynced, renamed over the old one, the rename
        fsynced. Blocking: call it in a thread. Nothing to do without a state_dir."""
        if not self.durable:
            return
        write_json_atomically(self.record_path, record)

    def _restore(self) -> None:
        """Read the record back (if any): every recorded version becomes loaded (with a new LoRA id) and the
        engines load them before serving (pool.start). Directories no record names (a commit killed before its
        record was written, a version retired before the kill) are removed. Raises AdapterStateMismatch when this
        server cannot serve what is recorded."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.record_path.with_name(RECORD + ".tmp").unlink(missing_ok=True)
        record = json.loads(self.record_path.read_text()) if self.record_path.is_file() else None
        entries = {}
        if record is not None:
            if record.get("format") != FORMAT:
                raise AdapterStateMismatch(f"{self.record_path}: record format {record.get('format')!r}, this server "
                                           f"reads {FORMAT}")
            entries = record.get("adapters") or {}
        where = f"state_dir {self.root.parent} holds LoRA adapters {sorted(entries)}"
        drop = f"; or remove {self.record_path} and {self.root} to start without them"
        if entries and record.get("base") != self.base:
            raise AdapterStateMismatch(f"{where} trained on another base model than this server's: start it on "
                                       f"that model{drop}")
        if entries and not self.enabled:
            raise AdapterStateMismatch(f"{where}, but this server serves none (engine.lora.max_adapters 0): start "
                                       f"it with --max-adapters {len(entries)} or more{drop}")
        if len(entries) > self.cfg.max_adapters:
            raise AdapterStateMismatch(f"{where}: {len(entries)}, above this server's engine.lora.max_adapters="
                                       f"{self.cfg.max_adapters}: start it with --max-adapters {len(entries)}{drop}")
        trimmed = False
        for name, e in sorted(entries.items()):
            versions = sorted(e["versions"], key=lambda v: v["version"])
            if len(versions) > self.cfg.versions_kept:     # a server keeping fewer versions than the last one
                versions, trimmed = versions[-self.cfg.versions_kept:], True
            a = self.adapters[name] = Adapter(name, e.get("tenant", ""), latest=e["latest"])
            for v in versions:
                if v["rank"] > self.cfg.max_rank:
                    raise AdapterStateMismatch(f"{where}: {name!r} version {v['version']} has rank {v['rank']}, "
                                               f"above this server's engine.lora.max_rank={self.cfg.max_rank}: start "
                                               f"it with --max-lora-rank {v['rank']} or more{drop}")
                path = self.root / v["path"]
                missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (path / f).is_file()]
                if missing:
                    raise AdapterStateMismatch(f"{where}: {name!r} version {v['version']}'s files are missing "
                                               f"({', '.join(str(path / f) for f in missing)}): restore them{drop}")
                av = AdapterVersion(name, v["version"], self.new_id(), path, v["rank"], v["num_bytes"],
                                    list(v["modules"]))
                a.versions[av.version] = av
                self.by_id[av.lora_id] = av
            self.restored[name] = sorted(a.versions)
        if trimmed:
            log.warning("%s: keeping the last %d versions of each adapter (engine.lora.versions_kept)", where,
                        self.cfg.versions_kept)
            self.save(self.snapshot())
        live = {av.path for av in self.by_id.values()}
        for folder in self.root.iterdir():       # files of commits that never reached the record, or retired since
            if folder.name not in self.adapters:
                _remove(folder)
                continue
            for version in folder.iterdir():
                if version not in live:
                    _remove(version)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
