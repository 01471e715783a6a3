"""weights/transfer.py over FakeEngines (bookkeeping only; tests/integration/test_transfer_faults.py runs the real
thing): every bad InitWeightTransfer field is INVALID_ARGUMENT naming it before an engine acts, the group reaches
only allowed addresses, failures inside an engine map to statuses a trainer can act on (never INTERNAL), and a
trainer that goes away (its call cancelled, its rendezvous gone) closes the group at once."""
import asyncio
import ipaddress
import math
import socket

import grpc
import pytest
import torch
from safetensors.torch import save_file

from rollout_service.errors import ServiceError
from rollout_service.hosts import allowed_entry_problem, host_problem, peer_ip
from rollout_service.weights import transfer as transfer_mod
from rollout_service.weights.transfer import Meta, WeightTransfer
from tests.fake_engine import FakeEngine

LOOPBACK_CALLER = "ipv4:127.0.0.1:40000"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "10.0.0.5", "localhost", "trainer-0.cluster.local",
                                  "fe80::1%eth0", "node7"])
def test_host_names_and_addresses_pass(host):
    assert host_problem(host) is None


@pytest.mark.parametrize("host,why", [
    ("", "required"), ("127.0.0.1:80", "no port"), ("127.0.0/1", "no path"), ("http://127.0.0.1", "scheme"),
    ("12?.0,0.1", "neither"), ("[::1]", "brackets"), ("127.0.0", "not a valid IPv4"), ("256.1.1.1", "IPv4"),
    ("a" * 300, "at most"), ("-bad.example", "neither"), ("a b", "neither"), ("host\x00", "neither"),
    ("tcp://h:1", "scheme"), ("env://", "scheme")])
def test_bad_hosts_say_what_is_wrong(host, why):
    problem = host_problem(host)
    assert problem is not None and why in problem, problem


def test_peers_and_allowed_entries():
    assert peer_ip("ipv4:10.0.0.5:53412") == ipaddress.ip_address("10.0.0.5")
    assert peer_ip("ipv6:[::1]:53412") == ipaddress.ip_address("::1")
    assert peer_ip("ipv6:[::ffff:10.1.2.3]:5") == ipaddress.ip_address("10.1.2.3")
    assert peer_ip("unix:/tmp/s").is_loopback and peer_ip("testclient") is None and peer_ip("") is None
    assert peer_ip("192.168.1.2") == ipaddress.ip_address("192.168.1.2")        # an HTTP client's host
    for ok in ("caller", "10.0.0.0/8", "10.0.0.5", "::1", "trainer.local"):
        assert allowed_entry_problem(ok) is None
    for bad in ("10.0.0.0/33", "http://x", "a:b"):
        assert allowed_entry_problem(bad) is not None


def test_config_rejects_bad_allowed_hosts_and_caps():
    from rollout_service.config import ConfigError, load_config

    cfg = load_config(**{"security.weight_transfer_hosts": ["10.0.0.0/8", "caller"]})
    assert cfg.security.weight_transfer_hosts == ["10.0.0.0/8", "caller"]
    with pytest.raises(ConfigError, match="weight_transfer_hosts"):
        load_config(**{"security.weight_transfer_hosts": ["http://x"]})
    with pytest.raises(ConfigError, match="weight_transfer_max_timeout_s"):
        load_config(**{"engine.weight_transfer_max_timeout_s": 10.0})


class JoiningEngine(FakeEngine):
    """A FakeEngine with a weight-transfer backend whose join and receive do what a test says."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.join_error: BaseException | None = None
        self.receive_error: BaseException | None = None
        self.receive_gate: asyncio.Event | None = None   # receive waits for it (a trainer that has not sent yet)
        self.init_infos: list[dict] = []

    async def init_transfer(self, init_info):
        self.init_infos.append(init_info)
        self.events.append(("init_transfer",))
        if self.join_error is not None:
            raise self.join_error
        return 1

    async def close_transfer(self):
        self.events.append(("close_transfer",))

    async def prepare_transfer(self, update_info, target, record_path, on_receiving):
        on_receiving()
        if self.receive_gate is not None:
            await self.receive_gate.wait()
        if self.receive_error is not None:
            raise self.receive_error
        tensors = {n: torch.full(s, 2.0) for n, s in zip(update_info["names"], update_info["shapes"])}
        if record_path:
            save_file(tensors, record_path)
        self.prepared = (target, tensors)

    async def receive_transfer(self, update_info, record_path, on_receiving):
        """A LoRA adapter's tensors: received, recorded by one engine, loaded into no model."""
        self.events.append(("receive_transfer", bool(record_path)))
        on_receiving()
        if self.receive_gate is not None:
            await self.receive_gate.wait()
        if self.receive_error is not None:
            raise self.receive_error
        if record_path:
            save_file({n: torch.full(s, 2.0) for n, s in zip(update_info["names"], update_info["shapes"])},
                      record_path)


@pytest.fixture
def make_transfer(tmp_path):
    from rollout_service.pool.pool import EnginePool
    from rollout_service.weights.service import WeightService
    from tests.unit.conftest import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt")

    async def make(**kw):
        pool = EnginePool([JoiningEngine("e0")], max_queue=10, checkpoints={"policy": ckpt})
        await pool.start()
        weights = WeightService.create(pool, "float32", weights_roots=[str(tmp_path)])
        return pool, WeightTransfer(weights, "gloo", 5.0, **kw)
    return make


async def join(t: WeightTransfer, address="127.0.0.1", port=29500, ranks=1, timeout_s=0.0, caller=LOOPBACK_CALLER):
    group = None
    async for group in t.init("auto", address, port, ranks, timeout_s, caller=caller):
        pass
    return group


async def push(t: WeightTransfer, version: int):
    metas = [Meta("a.weight", "float32", (4, 3))]
    out = []
    async for item in t.push(version, "policy", "wait", True, metas, t.group.group_id if t.group else ""):
        out.append(item)
    return out


async def error_of(coro) -> ServiceError:
    try:
        await coro
    except ServiceError as e:
        return e
    raise AssertionError("no error")


def test_every_bad_init_field_is_invalid_argument_naming_it_before_an_engine_acts(make_transfer):
    async def main():
        pool, t = await make_transfer(max_timeout_s=60.0, max_ranks=8)
        cases = [({"address": "127.0.0.1:80"}, "master_address"), ({"address": "127.0.0/1"}, "master_address"),
                 ({"address": "http://127.0.0.1"}, "master_address"), ({"address": "12?.0,0.1"}, "master_address"),
                 ({"address": ""}, "master_address"), ({"port": 0}, "master_port"), ({"port": 70000}, "master_port"),
                 ({"ranks": 9}, "trainer_ranks"), ({"ranks": -1}, "trainer_ranks"),
                 ({"timeout_s": math.nan}, "timeout_s"), ({"timeout_s": math.inf}, "timeout_s"),
                 ({"timeout_s": -math.inf}, "timeout_s"), ({"timeout_s": 1e308}, "timeout_s"),
                 ({"timeout_s": 61.0}, "timeout_s"), ({"timeout_s": -1.0}, "timeout_s"),
                 ({"address": "no-such-host.invalid"}, "master_address")]
        for kw, field in cases:
            e = await error_of(join(t, **kw))
            assert e.code is grpc.StatusCode.INVALID_ARGUMENT and e.field == field, (kw, e)
            assert field in e.message and "Traceback" not in e.message, e.message
        e = await error_of(t.init("nccl", "127.0.0.1", 1, 1, 1.0).__anext__())
        assert e.code is grpc.StatusCode.INVALID_ARGUMENT and e.field == "backend"
        assert pool.engines[0].init_infos == [] and t.group is None          # no engine acted
        assert (await join(t, timeout_s=60.0)).joined                        # the cap itself is allowed
    asyncio.run(main())


def test_a_group_reaches_only_allowed_addresses(make_transfer):
    async def main():
        pool, t = await make_transfer()
        e = await error_of(join(t, address="127.0.0.1", caller="ipv4:10.0.0.5:1234"))     # not the caller's
        assert e.code is grpc.StatusCode.PERMISSION_DENIED and e.field == "master_address", e
        assert "10.0.0.5" in e.message and "weight_transfer_hosts" in e.message
        e = await error_of(join(t, address="10.0.0.6", caller="ipv4:10.0.0.5:1234"))      # a neighbour
        assert e.code is grpc.StatusCode.PERMISSION_DENIED
        e = await error_of(join(t, address="127.0.0.1", caller="garbage"))               # unknown caller
        assert e.code is grpc.StatusCode.PERMISSION_DENIED
        assert pool.engines[0].init_infos == []
        assert (await join(t, address="localhost")).joined                  # a loopback caller: loopback
        assert pool.engines[0].init_infos[-1]["master_address"] in ("127.0.0.1", "::1")   # dialled resolved
        g = await join(t, address="10.0.0.5", caller="ipv4:10.0.0.5:1234")                # its own address
        assert g.joined and pool.engines[0].init_infos[-1]["master_address"] == "10.0.0.5"

        _, wide = await make_transfer(allowed_hosts=["10.0.0.0/8", "localhost"])
        assert (await join(wide, address="10.9.9.9", caller="ipv4:192.168.0.1:1")).joined
        assert (await join(wide, address="127.0.0.1", caller="ipv4:192.168.0.1:1")).joined
        e = await error_of(join(wide, address="192.168.0.1", caller="ipv4:192.168.0.1:1"))   # caller not listed
        assert e.code is grpc.StatusCode.PERMISSION_DENIED
    asyncio.run(main())


@pytest.mark.parametrize("error,code,words", [
    (RuntimeError("joining the weight-transfer group failed in the worker: DistStoreError: Timed out after 3 "
                  "seconds waiting for clients"), grpc.StatusCode.DEADLINE_EXCEEDED, "join within"),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED, "join within"),
    (RuntimeError("joining the weight-transfer group failed in the worker: DistNetworkError: Ping failed, "
                  "invalid value returned from server"), grpc.StatusCode.UNAVAILABLE, "rendezvous"),
    (RuntimeError("e0: vLLM engine core died (EngineDeadError) while joining"), grpc.StatusCode.UNAVAILABLE,
     "restarts"),
])
def test_join_failures_are_statuses_a_trainer_can_act_on(make_transfer, error, code, words):
    async def main():
        pool, t = await make_transfer()
        pool.engines[0].join_error = error
        e = await error_of(join(t, timeout_s=3.0))
        assert e.code is code and words in e.message, e
        assert t.group is None and pool.engines[0].events[-1] == ("close_transfer",)
    asyncio.run(main())


@pytest.mark.parametrize("error,kill,code,words", [
    (RuntimeError("receiving policy weights failed in the worker: RuntimeError: [gloo] Timed out waiting 5000ms "
                  "for recv operation to complete"), False, grpc.StatusCode.DEADLINE_EXCEEDED, "waited"),
    (RuntimeError("receiving policy weights failed in the worker: RuntimeError: Connection closed by peer "
                  "[127.0.0.1]:4321"), False, grpc.StatusCode.ABORTED, "broke off"),
    (RuntimeError("e0: vLLM engine core died (EngineDeadError) while receiving policy weights"), True,
     grpc.StatusCode.UNAVAILABLE, "restarted at the committed version"),
    (ValueError("anything else"), False, grpc.StatusCode.ABORTED, "broke off"),
])
def test_push_failures_inside_an_engine_close_the_group_and_never_answer_internal(make_transfer, error, kill,
                                                                                 code, words):
    async def main():
        pool, t = await make_transfer(watch=False)
        await join(t)
        e0 = pool.engines[0]
        e0.receive_error = error
        if kill:
            real = e0.prepare_transfer

            async def dying(*a):            # the engine dies while it receives
                e0.kill()
                await real(*a)
            e0.prepare_transfer = dying
        e = await error_of(push(t, 1))
        assert e.code is code and words in e.message and "InitWeightTransfer" in e.message, e
        assert "policy version 0" in e.message                                  # what still serves
        assert t.group is None and pool.policy_version == 0
        e = await error_of(push(t, 1))                                          # the next push on it
        assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer" in e.message
    asyncio.run(main())


def test_a_cancelled_push_closes_its_group_at_once_and_the_commit_ends_all_or_none(make_transfer):
    async def main():
        pool, t = await make_transfer(watch=False)
        g = await join(t)
        e0 = pool.engines[0]
        e0.receive_gate = asyncio.Event()
        items = []

        async def run():
            async for item in t.push(1, "policy", "wait", True, [Meta("a.weight", "float32", (4, 3))], g.group_id):
                items.append(item)
        task = asyncio.ensure_future(run())
        while not items:
            await asyncio.sleep(0.01)
        assert items[0][0] == "ready"
        task.cancel()                                         # the trainer was killed: its call is cancelled
        await asyncio.gather(task, return_exceptions=True)
        assert t.group is None and not g.joined               # at once: GetStatus shows no joined group
        assert "went away" in t.last_error[0]
        e = await error_of(push(t, 2))
        assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "went away" in e.message
        e = await error_of(join(t))                           # the engines are still ending the push
        assert e.code is grpc.StatusCode.UNAVAILABLE and "retry" in e.message
        e0.receive_error = RuntimeError("Connection closed by peer")
        e0.receive_gate.set()
        await t.settling
        assert e0.events[-1] == ("close_transfer",) and pool.policy_version == 0
        assert (await join(t)).joined                         # and a new group forms
    asyncio.run(main())


def test_a_trainer_whose_rendezvous_goes_away_closes_its_group(make_transfer, monkeypatch):
    monkeypatch.setattr(transfer_mod, "WATCH_S", 0.05)

    async def main():
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        pool, t = await make_transfer()
        g = await join(t, port=port)
        await asyncio.sleep(0.3)
        assert t.group is g and g.joined                      # answering: it stays
        listener.close()                                      # the trainer's rank 0 is gone
        for _ in range(100):
            if t.group is None:
                break
            await asyncio.sleep(0.05)
        assert t.group is None and "stopped answering" in t.last_error[0]
        assert pool.engines[0].events[-1] == ("close_transfer",)
        from rollout_service.server.grpc_service import RolloutServicer
        from rollout_service.validation import Limits

        servicer = RolloutServicer(pool, type("Model", (), {"path": "m", "vocab_size": 10, "max_model_len": 64,
                                                            "moe": None})(), Limits(1, 1), t.weights, transfer=t)
        st = servicer.status()                                # GetStatus says so
        assert not st.weight_transfer.joined and any("stopped answering" in w for w in st.warnings), st.warnings
        e = await error_of(push(t, 1))
        assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "stopped answering" in e.message
    asyncio.run(main())


def test_a_push_checks_the_rendezvous_first(make_transfer):
    async def main():
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        pool, t = await make_transfer()
        g = await join(t, port=port)
        t._watcher.cancel()                                   # only the push's own check
        listener.close()
        e = await error_of(push(t, 1))
        assert e.code is grpc.StatusCode.FAILED_PRECONDITION and "does not answer" in e.message
        assert t.group is None and not g.joined and pool.policy_version == 0
    asyncio.run(main())
