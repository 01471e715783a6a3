"""Session routing (pool/sessions.py): a session's requests stay on one engine while it is ready and not overloaded,
move (and are remembered there) otherwise; the table is LRU-bounded and forgets restarted or removed engines.
The table alone, then through EnginePool on FakeEngine, the contract's check and the dialects' keys (no vLLM).
A real two-engine service: tests/integration/test_sessions.py."""
import asyncio

import grpc
import httpx
import pytest

from rollout_client import build_request
from rollout_service.engine.base import EngineState
from rollout_service.errors import ServiceError
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.sessions import SessionTable
from rollout_service.server.convert import status_to_proto
from rollout_service.server.grpc_service import RolloutServicer
from rollout_service.server.http_app import build_http_app
from rollout_service.validation import MAX_SESSION_ID, Limits, check_generate
from rollout_service.weights.service import WeightService
from tests.fake_engine import FakeEngine
from tests.unit.test_http_dialects import Tokenizer
from tests.unit.test_pool import collect, groups


class E:
    def __init__(self, engine_id):
        self.id = engine_id


A, B, C = E("a"), E("b"), E("c")


def test_a_session_sticks_to_its_engine_and_new_sessions_go_least_loaded():
    t = SessionTable(max_sessions=10, max_imbalance=4)
    load = {"a": 0, "b": 0}
    assert t.route("s1", [A, B], load) is A               # new: least-loaded (first on a tie)
    load["a"] += 3
    assert t.route("s2", [A, B], load) is B               # new: least-loaded
    for _ in range(3):
        assert t.route("s1", [A, B], load) is A           # 3 more than b: within max_imbalance
    assert t.route("", [A, B], load) is B                  # no key: least-loaded, nothing remembered
    assert t.counts == {"hit": 3, "moved_unavailable": 0, "moved_overloaded": 0, "started": 2}
    assert len(t) == 2 and dict(t.per_engine) == {"a": 1, "b": 1}


def test_overloaded_past_the_limit_moves_the_session_and_it_stays_moved():
    t = SessionTable(max_sessions=10, max_imbalance=4)
    load = {"a": 0, "b": 0}
    t.route("s", [A, B], load)
    load["a"] = 4
    assert t.route("s", [A, B], load) is A                # exactly the limit: stays
    load["a"] = 5
    assert t.route("s", [A, B], load) is B                # past it: least-loaded, the session moves
    load["a"] = 0
    assert t.route("s", [A, B], load) is B                # remembered on b now, even with a idle
    assert t.counts["moved_overloaded"] == 1 and t.counts["hit"] == 2 and t.engine_of["s"] == "b"


def test_an_engine_not_ready_moves_its_sessions():
    t = SessionTable(max_sessions=10, max_imbalance=100)
    load = {"a": 0, "b": 5, "c": 1}
    assert t.route("s", [A, B, C], load) is A
    assert t.route("s", [B, C], load) is C                # a restarting / draining: least-loaded of the others
    assert t.route("s", [A, B, C], load) is C             # and it stays there when a is back
    assert t.counts["moved_unavailable"] == 1 and dict(t.per_engine) == {"c": 1}


def test_the_table_is_lru_bounded_and_forgets_engines():
    t = SessionTable(max_sessions=3, max_imbalance=0)
    load = {"a": 0, "b": 0}
    for key in ("s1", "s2", "s3"):
        t.route(key, [A], load)
    t.route("s1", [A], load)                              # touched: s2 is now the least recently used
    t.route("s4", [B], load)
    assert list(t.engine_of) == ["s3", "s1", "s4"] and t.evicted == 1
    assert dict(t.per_engine) == {"a": 2, "b": 1}
    assert t.forget_engine("a") == 2 and list(t.engine_of) == ["s4"] and dict(t.per_engine) == {"b": 1}
    assert t.forget_engine("a") == 0
    t.route("s1", [A, B], load)                           # forgotten: routed as a new session
    assert t.counts["started"] == 5


def test_max_sessions_zero_turns_session_routing_off():
    t = SessionTable(max_sessions=0)
    load = {"a": 2, "b": 0}
    assert t.route("s", [A, B], load) is B and len(t) == 0 and t.counts["started"] == 0


async def make_pool(engines=2, **kw):
    pool = EnginePool([FakeEngine(f"e{i}") for i in range(engines)], max_queue=200, **kw)
    await pool.start()
    return pool


def where(pool, tag) -> set[str]:
    return {e.id for e in pool.engines for r in e.seen if r.seq_id.startswith(tag)}


def test_pool_turns_of_a_session_stay_on_one_engine_while_other_traffic_balances():
    async def main():
        pool = await make_pool(2, session_max_imbalance=64)
        homes = {}
        for turn in range(4):
            # other work lands least-loaded meanwhile (most of it on whichever engine is idler)
            other = pool.submit("", b"o", groups(3, 2, max_tokens=20, tag=f"o{turn}"))
            recs = [pool.submit("", b"x", groups(1, 1, max_tokens=5, tag=f"s{k}t{turn}"), session=f"conv-{k}")
                    for k in range(4)]
            for rec in (other, *recs):
                await collect(pool, rec)
            for k in range(4):
                homes.setdefault(k, where(pool, f"s{k}t0-"))
                assert where(pool, f"s{k}t{turn}-") == homes[k], (k, turn)
        assert {next(iter(h)) for h in homes.values()} == {"e0", "e1"}    # new sessions were spread
        c = pool.sessions.counts
        assert (c["started"], c["hit"]) == (4, 12)
        status = status_to_proto(pool, "m", 100, 256)
        assert status.sessions.sessions == 4 and status.sessions.hits == 12 and status.sessions.started == 4
        assert sum(e.sessions for e in status.engines) == 4 and all(e.sessions for e in status.engines)
        metric = pool.telemetry.registry.get_sample_value
        assert metric("rollout_session_requests_total", {"outcome": "hit"}) == 12
        assert metric("rollout_sessions") == 4
    asyncio.run(main())


def test_pool_every_prompt_of_a_session_request_goes_to_its_engine():
    async def main():
        pool = await make_pool(2)
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="first"), session="s"))
        home = where(pool, "first-")
        await collect(pool, pool.submit("", b"x", groups(5, 3, tag="batch"), session="s"))
        assert where(pool, "batch-") == home
    asyncio.run(main())


def test_pool_unhealthy_engine_moves_the_session_restart_forgets_it_retire_too():
    async def main():
        pool = await make_pool(3)
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="t0"), session="s"))
        (home,) = where(pool, "t0-")
        engine = next(e for e in pool.engines if e.id == home)
        pool.mark_unhealthy(engine, "test")
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="t1"), session="s"))
        (moved,) = where(pool, "t1-")
        assert moved != home and pool.sessions.counts["moved_unavailable"] == 1
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="u0"), session="u"))
        (u_home,) = where(pool, "u0-")
        assert await pool.restart_at_committed(engine) and engine.state is EngineState.READY
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="t2"), session="s"))
        assert where(pool, "t2-") == {moved}                 # the move was remembered
        # a restarted engine's cache is empty: its sessions are forgotten
        u_engine = next(e for e in pool.engines if e.id == u_home)
        assert await pool.restart_at_committed(u_engine)
        assert "u" not in pool.sessions.engine_of
        # an engine that leaves the pool: its sessions are forgotten
        s_engine = next(e for e in pool.engines if e.id == moved)
        await pool.retire(s_engine, timeout_s=5)
        assert "s" not in pool.sessions.engine_of and moved not in pool.sessions.per_engine
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="t3"), session="s"))
        assert where(pool, "t3-") and moved not in where(pool, "t3-")
    asyncio.run(main())


def test_pool_overloaded_engine_moves_the_session():
    async def main():
        pool = await make_pool(2, session_max_imbalance=2)
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="t0"), session="s"))
        (home,) = where(pool, "t0-")
        # pin 4 long sequences on the session's engine (a session of its own keeps them there)
        busy = pool.submit("", b"b", groups(1, 4, max_tokens=200, tag="busy"), session="s")
        assert pool.load[home] == 4
        await collect(pool, pool.submit("", b"x", groups(1, 1, tag="t1"), session="s"))
        assert home not in where(pool, "t1-") and pool.sessions.counts["moved_overloaded"] == 1
        await collect(pool, busy)
    asyncio.run(main())


MODEL = ModelInfo(path="m", vocab_size=100, max_model_len=256, tokenizer=Tokenizer())


@pytest.mark.parametrize("sid,needle", [
    ("x" * (MAX_SESSION_ID + 1), f"at most {MAX_SESSION_ID} characters"),
    ("conv\n1", "character 4 is U+000A"),
    ("café", "character 3 is U+00E9"),
])
def test_a_bad_session_id_is_invalid_argument_naming_it(sid, needle):
    with pytest.raises(ServiceError) as e:
        check_generate(build_request([[1]], session_id=sid), MODEL, Limits(4, 8))
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "session_id"
    assert e.value.message.startswith("session_id: ") and needle in e.value.message


def test_good_session_ids_pass_and_reach_the_checked_request():
    for sid in ("", "a", "user 42/conv-7:turn", "~" * MAX_SESSION_ID):
        assert check_generate(build_request([[1]], session_id=sid), MODEL, Limits(4, 8)).session_id == sid


@pytest.fixture
def http_pool():
    async def build(key_from=None):
        pool = EnginePool([FakeEngine(f"e{i}", vocab_size=100) for i in range(2)], max_queue=50)
        await pool.start()
        weights = WeightService.create(pool, "float32", weights_roots=["/tmp"])
        servicer = RolloutServicer(pool, MODEL, Limits(4, 8), weights)
        app = build_http_app(servicer, None, key_from)
        return pool, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return build


def test_dialects_read_the_routers_session_headers_and_fields(http_pool):
    async def main():
        pool, c = await http_pool()
        sent = [("/v1/completions", {"prompt": [5], "max_tokens": 2}, {"X-Session-ID": "a"}),
                ("/v1/completions", {"prompt": [5], "max_tokens": 2}, {"x-user-id": "b"}),
                ("/v1/completions", {"prompt": [5], "max_tokens": 2, "session_id": "c"}, {}),
                ("/inference/v1/generate", {"token_ids": [5], "sampling_params": {"max_tokens": 2}},
                 {"x-session-id": "d"}),
                ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}},
                 {"X-SMG-Routing-Key": "e"}),
                ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}, "routing_key": "f"}, {}),
                ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}, "session_id": 7}, {}),
                # a header wins over the body; `user` is not a key by default
                ("/v1/completions", {"prompt": [5], "max_tokens": 2, "session_id": "no"}, {"x-session-id": "g"}),
                ("/v1/completions", {"prompt": [5], "max_tokens": 2, "user": "alice"}, {})]
        for path, body, headers in sent:
            r = await c.post(path, json=body, headers=headers)
            assert r.status_code == 200, (path, r.text)
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2}, headers={"x-session-id": "h"})
        assert r.status_code == 200, r.text
        # the next turn finds the history in its engine's (fake) prefix cache, and each dialect says so
        turn = r.json()["prompt_token_ids"] + r.json()["choices"][0]["token_ids"] + [9, 9]
        r = await c.post("/v1/completions", json={"prompt": turn, "max_tokens": 2}, headers={"x-session-id": "h"})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(turn) - 2
        r = await c.post("/generate", json={"input_ids": turn, "sampling_params": {"max_new_tokens": 2}},
                         headers={"x-smg-routing-key": "h"})
        assert r.json()["meta_info"]["cached_tokens"] == len(turn) - 1
        assert set(pool.sessions.engine_of) == {"a", "b", "c", "d", "e", "f", "7", "g", "h"}
    asyncio.run(main())


def test_dialects_key_on_configured_names_and_refuse_bad_keys_naming_them(http_pool):
    async def main():
        pool, c = await http_pool(["x-conversation", "user"])
        for body, headers in (({"prompt": [5], "max_tokens": 2, "user": "alice"}, {}),
                              ({"prompt": [5], "max_tokens": 2}, {"X-Conversation": "k"}),
                              ({"prompt": [5], "max_tokens": 2}, {"x-session-id": "ignored"})):
            assert (await c.post("/v1/completions", json=body, headers=headers)).status_code == 200
        assert set(pool.sessions.engine_of) == {"alice", "k"}
        bad = [({"prompt": [5], "user": "x" * 300}, {}, "user"),
               ({"prompt": [5], "user": ["x"]}, {}, "user"),
               ({"prompt": [5]}, {"x-conversation": "a\tb"}, "x-conversation")]
        for body, headers, param in bad:
            r = await c.post("/v1/completions", json=body, headers=headers)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and "session key" in err["message"], r.text
        r = await c.post("/generate", json={"input_ids": [5], "user": "é" * 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
        assert pool.depth == 0 and len(pool.sessions) == 2
    asyncio.run(main())
