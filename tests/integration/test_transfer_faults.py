"""Hostile and broken weight-transfer set-ups on the shared real service (real vLLM, real gRPC, real gloo): every bad
field is INVALID_ARGUMENT naming it before an engine acts, addresses other than the caller's are PERMISSION_DENIED,
a join nobody completes ends at its timeout once while Generate goes on, and a trainer that is killed (or whose
call is cancelled mid-push) closes its group at once: GetStatus says so and the next push is FAILED_PRECONDITION."""
import math
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import grpc
import pytest
from rollout_client.api import pb
from rollout_client.transfer import WeightSync, _free_port

from tests.integration.test_weight_transfer import code_of, transfer_request
from tests.integration.test_weights import assert_serves


def init_call(client, timeout=60, **fields):
    req = pb.WeightTransferInit(**({"master_address": "127.0.0.1", "master_port": 29999} | fields))
    return client.stub.InitWeightTransfer(req, metadata=client.auth.admin(), timeout=timeout)


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("fields,field,code", [
    ({"master_address": "127.0.0.1:80"}, "master_address", grpc.StatusCode.INVALID_ARGUMENT),
    ({"master_address": "127.0.0/1"}, "master_address", grpc.StatusCode.INVALID_ARGUMENT),
    ({"master_address": "http://127.0.0.1"}, "master_address", grpc.StatusCode.INVALID_ARGUMENT),
    ({"master_address": "12?.0,0.1"}, "master_address", grpc.StatusCode.INVALID_ARGUMENT),
    ({"master_address": ""}, "master_address", grpc.StatusCode.INVALID_ARGUMENT),
    ({"master_port": 0}, "master_port", grpc.StatusCode.INVALID_ARGUMENT),
    ({"master_port": 65536}, "master_port", grpc.StatusCode.INVALID_ARGUMENT),
    ({"trainer_ranks": 5000}, "trainer_ranks", grpc.StatusCode.INVALID_ARGUMENT),
    ({"timeout_s": math.nan}, "timeout_s", grpc.StatusCode.INVALID_ARGUMENT),
    ({"timeout_s": math.inf}, "timeout_s", grpc.StatusCode.INVALID_ARGUMENT),
    ({"timeout_s": 1e308}, "timeout_s", grpc.StatusCode.INVALID_ARGUMENT),
    ({"timeout_s": -1}, "timeout_s", grpc.StatusCode.INVALID_ARGUMENT),
    ({"master_address": "10.255.255.1"}, "master_address", grpc.StatusCode.PERMISSION_DENIED),   # not the caller
    ({"master_address": "169.254.169.254", "master_port": 80}, "master_address", grpc.StatusCode.PERMISSION_DENIED),
])
def test_bad_set_ups_are_refused_naming_the_field_before_an_engine_acts(client, fields, field, code):
    t = time.monotonic()
    got, msg = code_of(lambda: next(init_call(client, **fields)))
    assert got == code and field in msg and "Traceback" not in msg, (got, msg)
    assert time.monotonic() - t < 10
    st = client.status()
    assert st.ready and not st.weight_transfer.joined


def test_a_join_nobody_completes_ends_at_its_timeout_once_while_generation_goes_on(client):
    """The trainer's rank 0 hosts the rendezvous but never forms its group: torch waited a timeout for the store and
    another for gloo (twice the timeout); the join ends at its timeout, and Generate is served meanwhile."""
    from torch.distributed import TCPStore

    port = _free_port("127.0.0.1")
    store = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60), wait_for_workers=False)
    timeout_s = 8.0
    stream = init_call(client, master_port=port, timeout_s=timeout_s)
    t0 = time.monotonic()
    assert not next(stream).joined                                 # the engines are joining now
    took = []
    while time.monotonic() - t0 < timeout_s - 2:
        t = time.monotonic()
        client.generate_all([[1, 504, 3458, 28]], n=2, max_tokens=8, temperature=1.0, seed=len(took))
        took.append(time.monotonic() - t)
    code, msg = code_of(lambda: next(stream))
    waited = time.monotonic() - t0
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "trainer rank" in msg, msg
    assert timeout_s - 1 < waited < timeout_s + 8, waited                 # once, not twice
    assert len(took) >= 2 and max(took) < 5, took                         # generation went on
    st = client.status()
    assert st.ready and not st.weight_transfer.joined
    del store


def test_a_port_where_something_else_listens_is_unavailable_not_internal(service, client):
    t = time.monotonic()
    code, msg = code_of(lambda: list(init_call(client, master_port=service.http_port, timeout_s=5)))
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), (code, msg)
    assert "InitWeightTransfer" in msg and time.monotonic() - t < 20
    assert client.status().ready


TRAINER = textwrap.dedent("""
    import sys, time
    from rollout_client import RolloutClient
    from rollout_client.transfer import WeightSync
    client = RolloutClient(sys.argv[1])
    sync = WeightSync(client, timeout_s=20)
    sync.connect(timeout=60)
    print(sync.group.group_id, flush=True)
    time.sleep(600)
""")


def test_a_killed_trainer_closes_its_group_and_the_next_push_is_refused(service, client, policy):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, service.target], stdout=subprocess.PIPE, text=True)
    try:
        group_id = trainer.stdout.readline().strip()
        assert group_id and client.status().weight_transfer.joined
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        t = time.monotonic()
        assert wait_until(lambda: not client.status().weight_transfer.joined, 10), "the dead trainer's group stayed"
        assert time.monotonic() - t < 10
    finally:
        trainer.kill()
    v0 = client.status().policy_version
    req = pb.TransferRequest(version=v0 + 1, group_id=group_id, in_flight=pb.IN_FLIGHT_WAIT,
                             tensors=[pb.TensorMeta(name="model.norm.weight", dtype="float32", shape=[64])])
    code, msg = code_of(lambda: next(client.stub.TransferWeights(req, metadata=client.auth.admin())))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer" in msg, msg
    assert "stopped answering" in msg or "no weight-transfer group" in msg, msg
    assert client.status().policy_version == v0


def test_a_push_whose_call_is_cancelled_closes_its_group_at_once(client, policy):
    """The trainer went away after `ready` (its call is cancelled): GetStatus shows the group closed at once, the
    next push on it is FAILED_PRECONDITION, the served version is unchanged, and a new group then works."""
    sync = WeightSync(client, timeout_s=5)
    sync.connect(timeout=60)
    v0 = client.status().policy_version
    state = {k: v + 1.0 for k, v in policy.state_dict().items()}
    call = client.stub.TransferWeights(transfer_request(sync, state, v0 + 1), metadata=client.auth.admin())
    assert next(call).WhichOneof("item") == "ready"
    call.cancel()
    assert wait_until(lambda: not client.status().weight_transfer.joined, 3), "the group stayed joined"
    code, msg = code_of(lambda: next(client.stub.TransferWeights(transfer_request(sync, state, v0 + 1),
                                                               metadata=client.auth.admin())))
    assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE), (code, msg)
    sync.pg.shutdown()
    sync.pg = None
    st = client.status()
    assert st.ready and st.policy_version == v0
    assert_serves(client, policy, v0)
    again = WeightSync(client, timeout_s=20)
    deadline = time.monotonic() + 30                 # the engines end the abandoned push first (its timeout)
    while True:
        try:
            again.connect(timeout=60)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
            time.sleep(1)
    assert again.push(policy, v0 + 1).version == v0 + 1
    assert_serves(client, policy, v0 + 1)
    again.close()


def test_generate_is_served_while_a_push_waits_for_a_stalled_trainer(client, policy):
    """A stalled trainer (ready, never sends) fails its push at the group's timeout as DEADLINE_EXCEEDED, closes
    the group, and Generate is served throughout."""
    sync = WeightSync(client, timeout_s=6)
    sync.connect(timeout=60)
    v0 = client.status().policy_version
    call = client.stub.TransferWeights(transfer_request(sync, policy.state_dict(), v0 + 1),
                                       metadata=client.auth.admin())
    assert next(call).WhichOneof("item") == "ready"
    out = {}
    threading.Thread(target=lambda: out.update(r=code_of(lambda: next(call)))).start()
    took = []
    t0 = time.monotonic()
    while "r" not in out and time.monotonic() - t0 < 40:
        t = time.monotonic()
        client.generate_all([[1, 504, 3458, 28]], n=2, max_tokens=8, temperature=1.0, seed=len(took))
        took.append(time.monotonic() - t)
    assert wait_until(lambda: "r" in out, 30)
    code, msg = out["r"]
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "InitWeightTransfer" in msg, msg
    assert max(took) < 5, took
    st = client.status()
    assert st.policy_version == v0 and not st.weight_transfer.joined
    sync.pg.shutdown()
    sync.pg = None


def test_a_push_shows_no_per_layer_reload_warnings(service, client, policy):
    """vLLM warned "RotaryEmbedding / ParallelLMHead: Failed to load weights" on every push (they get no tensors by
    design); the service says so once instead."""
    sync = WeightSync(client, timeout_s=20)
    sync.connect(timeout=60)
    v = client.status().policy_version + 1
    assert sync.push(policy, v).version == v
    sync.close()
    log = service.log_path.read_text(errors="replace")
    assert "Failed to load weights" not in log.replace('"Failed to load weights" warnings', ""), \
        [line for line in log.splitlines() if "Failed to load weights" in line][:5]
    assert "rotary embeddings (computed, not weights)" in log                    # said once per worker instead


def test_an_engine_that_dies_mid_transfer_answers_unavailable_and_the_committed_version_serves(tiny_model, tmp_path):
    """Its own service: the engine core is SIGKILLed while it receives; the push answers UNAVAILABLE saying to retry
    once the engine restarted at the committed version, and it does."""
    import os

    import psutil
    from rollout_client import RolloutClient
    from tests.integration.services import running_service, wait_for
    from tests.integration.test_faults import engine_cores
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with running_service(tiny_model, tmp_path / "service.log", clean_exit=False) as svc, \
            RolloutClient(svc.target) as c:
        sync = WeightSync(c, timeout_s=30)
        sync.connect(timeout=60)
        v0 = c.status().policy_version
        call = c.stub.TransferWeights(transfer_request(sync, policy.state_dict(), v0 + 1), metadata=c.auth.admin())
        assert next(call).WhichOneof("item") == "ready"
        [core] = engine_cores(svc.proc.pid)
        os.kill(core.pid, signal.SIGKILL)
        code, msg = code_of(lambda: next(call))
        assert code == grpc.StatusCode.UNAVAILABLE and "restarted at the committed version" in msg, (code, msg)
        st = wait_for(lambda: (s := c.status()).ready and s.engines[0].restarts == 1 and s, 240, "the restart")
        assert st.policy_version == v0 and not st.weight_transfer.joined
        sync.pg.shutdown()
        assert psutil.pid_exists(svc.proc.pid)
