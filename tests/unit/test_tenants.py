"""Tenants: tokens scoped to their adapters, admission quotas, and the fair gate that shares each engine's batch
between tenants (FakeEngines; the latency bench is bench/tenants.py)."""
import asyncio

import grpc
import pytest

from rollout_service.config import ServerConfig, TenantConfig
from rollout_service.errors import ServiceError
from rollout_service.engine.types import SeqRequest
from rollout_service.pool.fair import FairGate, reserve_of
from rollout_service.pool.pool import EnginePool
from rollout_service.server.auth import check_scope, load_credentials
from tests.fake_engine import FakeEngine

A, ADMIN, T1, T2 = "a" * 20, "b" * 20, "c" * 20, "d" * 20


def test_tenant_tokens_roles_and_scope(monkeypatch):
    monkeypatch.setenv("ROLLOUT_AUTH_TOKEN", A)
    monkeypatch.setenv("ROLLOUT_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("T1_TOKEN", T1)
    cfg = ServerConfig()
    cfg.security.tenants = [TenantConfig(name="team1", token_env="T1_TOKEN", policies=["alice", "exp-*"],
                                         max_sequences=8)]
    creds = load_credentials(cfg.security, "127.0.0.1")
    assert creds.role(f"Bearer {T1}") == "tenant:team1" and creds.role(f"Bearer {T2}") is None
    t = creds.tenant("tenant:team1")
    assert t.owns("alice") and t.owns("exp-7") and not t.owns("bob") and not t.owns("")
    check_scope(t, None, "exp-1", "sample")
    for policy in ("bob", ""):
        with pytest.raises(ServiceError) as e:
            check_scope(t, None, policy, "sample")
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "team1" in str(e.value)
    assert "admin token" in str(e.value)                         # the base policy
    check_scope(None, "client", "", "sample")                    # the admin and client tokens: as before
    monkeypatch.setenv("T1_TOKEN", A)                            # a tenant token equal to the client token
    with pytest.raises(ValueError, match="must differ"):
        load_credentials(cfg.security, "127.0.0.1")


def seqs(n, name):
    return [[SeqRequest(seq_id=f"{name}-{i}", prompt_token_ids=[1, 2], max_tokens=20)] for i in range(n)]


def test_quota_refuses_a_tenant_beyond_its_sequences():
    async def main():
        pool = EnginePool([FakeEngine("e0", step_s=0.002)], max_queue=100)
        await pool.start()
        pool.submit("", b"x", seqs(3, "a"), tenant="team1", quota=4)
        with pytest.raises(ServiceError) as e:
            pool.submit("", b"y", seqs(2, "b"), tenant="team1", quota=4)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "team1" in str(e.value)
        pool.submit("", b"z", seqs(2, "c"), tenant="team2", quota=4)    # another tenant's quota is its own
        assert pool.tenant_load == {"team1": 3, "team2": 2}
    asyncio.run(main())


def test_fair_gate_gives_a_freed_slot_to_the_tenant_with_fewest_running():
    async def main():
        gate = FairGate(2, reserve=0)                             # the pick order alone (the reserve: below)
        order = []

        async def one(tenant, i):
            await gate.acquire("e0", tenant)
            order.append((tenant, i))
        await one("flood", 0)
        await one("flood", 1)                                     # both slots taken
        waiting = [asyncio.create_task(one("flood", i)) for i in range(2, 6)]
        await asyncio.sleep(0)
        small = asyncio.create_task(one("small", 0))
        await asyncio.sleep(0)
        gate.release("e0", "flood")
        await asyncio.sleep(0)
        assert order[-1] == ("small", 0)                          # ahead of the flood's queued four
        gate.release("e0", "flood")
        await asyncio.sleep(0)
        assert order[-1] == ("flood", 2)
        waiting[-1].cancel()                                      # a cancelled waiter never takes a slot
        await asyncio.sleep(0)
        for _ in range(3):
            gate.release("e0", "flood" if gate.running["e0"]["flood"] else "small")
            await asyncio.sleep(0)
        assert ("flood", 5) not in order and sum(gate.running["e0"].values()) <= 2
        await small
        await asyncio.gather(*waiting, return_exceptions=True)
    asyncio.run(main())


def test_fair_gate_keeps_its_reserve_for_a_tenant_below_its_share():
    """vLLM never preempts a running sequence: a flood holding every slot would make a newcomer wait for one of
    its sequences to end. The last slots go only to a tenant below its share of the rest, so it starts at once."""
    assert [reserve_of(n) for n in (0, 1, 2, 4, 16, 31, 32, 64, 256)] == [0, 0, 1, 1, 1, 1, 2, 4, 16]

    async def main():
        gate = FairGate(4)                                        # reserve 1: 3 shared
        flood = [asyncio.create_task(gate.acquire("e0", "flood")) for _ in range(6)]
        await asyncio.sleep(0)
        assert gate.running["e0"] == {"flood": 3} and gate.waiting_of("flood") == 3   # alone: never the reserve
        await asyncio.wait_for(gate.acquire("e0", "small"), 1)   # at once, ahead of the flood's waiting three
        assert gate.running["e0"] == {"flood": 3, "small": 1}
        gate.release("e0", "flood")
        await asyncio.sleep(0)
        assert gate.running["e0"] == {"flood": 2, "small": 1}    # the freed slot is the reserve again
        gate.release("e0", "small")                               # small's sequence ended: the flood gets the
        await asyncio.sleep(0)                                    # shared slots, never the reserve
        assert gate.running["e0"] == {"flood": 3} and gate.waiting_of("flood") == 2
        await asyncio.wait_for(gate.acquire("e0", "small"), 1)   # small's next sequence: at once
        assert gate.running["e0"] == {"flood": 3, "small": 1}
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        assert gate.waiting_of("flood") == 0

        gate = FairGate(16)                                       # two floods balancing do not eat the reserve
        tasks = [asyncio.create_task(gate.acquire("e0", t)) for _ in range(12) for t in ("a", "b")]
        await asyncio.sleep(0)
        assert sorted(gate.running["e0"].values()) == [7, 8]
        await asyncio.wait_for(gate.acquire("e0", "small"), 1)
        assert sum(gate.running["e0"].values()) == 16
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(main())


def test_pool_with_fair_slots_starts_a_small_tenant_before_a_flood():
    async def main():
        eng = FakeEngine("e0", step_s=0.002)
        pool = EnginePool([eng], max_queue=200, fair_slots=4)
        await pool.start()
        flood = pool.submit("", b"f", seqs(24, "flood"), tenant="flood")
        await asyncio.sleep(0.01)
        small = pool.submit("", b"s", seqs(1, "small"), tenant="small")
        await asyncio.wait_for(asyncio.gather(*small.tasks), 5)
        started = [s.seq_id for s in eng.seen]
        assert started.index("small-0") == 3, started            # the flood's first 3 (of 4 slots), then small
        assert not flood.done
        await asyncio.wait_for(asyncio.gather(*flood.tasks), 10)
        assert pool.tenant_load == {"flood": 0, "small": 0} and pool.tenant_samples == {"flood": 24, "small": 1}
    asyncio.run(main())


def test_http_dialects_hold_a_tenant_to_its_adapters(tmp_path):
    """On the vLLM dialect a tenant's token samples its own adapter (`model`), never another tenant's or the base;
    the adapter endpoints need the admin token."""
    import httpx

    from rollout_service.model_info import ModelInfo
    from rollout_service.server.auth import Credentials, Tenant
    from rollout_service.server.grpc_service import RolloutServicer
    from rollout_service.server.http_app import build_http_app
    from rollout_service.validation import Limits
    from tests.unit.test_adapters import make, push, write_base

    async def main():
        ckpt = write_base(tmp_path / "base")
        pool, weights, _ = await make(ckpt, engines=1)
        await push(weights, "alice", 1)
        await push(weights, "bob", 1)
        creds = Credentials(A, ADMIN, ((T1, Tenant("team1", ("alice",), 0)),))
        model = ModelInfo(path=str(ckpt), vocab_size=50, max_model_len=256, tokenizer=None)
        servicer = RolloutServicer(pool, model, Limits(8, 8), weights, creds=creds)
        app = build_http_app(servicer, creds)
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "temperature": 1.0}}
        auth = {"Authorization": f"Bearer {T1}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/inference/v1/generate", json=body | {"model": "alice"}, headers=auth)
            assert r.status_code == 200, r.text
            for model_name in ("bob", str(ckpt)):
                r = await c.post("/inference/v1/generate", json=body | {"model": model_name}, headers=auth)
                assert r.status_code == 403 and "team1" in r.text, r.text
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "alice", "lora_path": "/x"}, headers=auth)
            assert r.status_code == 403
            r = await c.post("/inference/v1/generate", json=body | {"model": "bob"},
                             headers={"Authorization": f"Bearer {A}"})      # the client token: anything served
            assert r.status_code == 200, r.text
        assert pool.tenant_samples["team1"] == 1
        # a tenant's status names its own adapters and its own entry, never another tenant's
        t1 = creds.tenant("tenant:team1")
        assert [a.name for a in servicer.status(t1).adapters] == ["alice"]
        assert [t.name for t in servicer.status(t1).tenants] == ["team1"]
        assert sorted(a.name for a in servicer.status().adapters) == ["alice", "bob"]      # the admin's view
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            seen = (await c.get("/v1/status", headers=auth)).json()
            assert [a["name"] for a in seen["adapters"]] == ["alice"], seen["adapters"]
            seen = (await c.get("/v1/status", headers={"Authorization": f"Bearer {ADMIN}"})).json()
            assert sorted(a["name"] for a in seen["adapters"]) == ["alice", "bob"]
    asyncio.run(main())
