"""Weights over a collective group (InitWeightTransfer / TransferWeights, the gloo backend) on the shared real
service: new weights serve (checked against an independent forward pass), sharded trainers, keep mode, and every
fault the contract names leaving the last committed version serving; and vLLM's weight-transfer endpoints
(the HTTP dialect) driven by TRL's own client."""
import threading
import time
import warnings

import grpc
import httpx
import pytest
import torch
from rollout_client.api import pb
from rollout_client.transfer import WeightSync, _free_port, metas_of, send, tensors_of
from rollout_client.trl_gloo import use_gloo

from tests.integration.test_weights import assert_serves, next_version, perturb


@pytest.fixture
def sync(client):
    s = WeightSync(client, timeout_s=20)
    s.connect(timeout=60)
    yield s
    s.close()


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def transfer_request(sync, state: dict, version: int, **kw) -> pb.TransferRequest:
    tensors = [pb.TensorMeta(name=n, dtype=d, shape=s) for n, d, s in metas_of(tensors_of(state))]
    return pb.TransferRequest(version=version, tensors=tensors, group_id=sync.group.group_id,
                              in_flight=pb.IN_FLIGHT_WAIT, **kw)


def test_transfer_push_serves_the_new_weights(client, policy, sync):
    g = client.status().weight_transfer
    assert g.backend == "gloo" and g.joined and g.world_size == 2 and [e.rank_offset for e in g.engines] == [1]
    perturb(policy, seed=11)
    v = next_version(client)
    res = sync.push(policy, v)
    assert res.version == v and res.target == "policy" and not res.partial and res.num_bytes > 0
    assert res.total_s >= res.pause_s > 0
    assert_serves(client, policy, v)
    perturb(policy, seed=12)                          # and again over the same group
    res = sync.push(policy, v + 1, mode="keep")
    assert res.version == v + 1
    assert_serves(client, policy, v + 1)


def test_bad_pushes_are_refused_before_a_byte_moves_and_the_group_stays_usable(client, policy, sync):
    v0 = client.status().policy_version
    state = policy.state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    wrong_shape = dict(state) | {name: torch.zeros(3, 3)}
    code, msg = code_of(lambda: next(client.stub.TransferWeights(transfer_request(sync, wrong_shape, v0 + 1),
                                                               metadata=client.auth.admin())))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and name in msg and "shape" in msg
    unknown = dict(state) | {"model.no_such.weight": torch.zeros(2)}
    code, msg = code_of(lambda: next(client.stub.TransferWeights(transfer_request(sync, unknown, v0 + 1),
                                                               metadata=client.auth.admin())))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model.no_such.weight" in msg
    wrong_dtype = {k: t.to(torch.float16) for k, t in state.items()}
    code, msg = code_of(lambda: sync.push(wrong_dtype, v0 + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in msg
    code, msg = code_of(lambda: sync.push(state, v0))             # not newer
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "newer" in msg
    stale = pb.TransferRequest(version=v0 + 1, group_id="nope", tensors=[pb.TensorMeta(name=name, dtype="float32")])
    code, msg = code_of(lambda: next(client.stub.TransferWeights(stale, metadata=client.auth.admin())))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "group_id" in msg
    assert client.status().policy_version == v0
    res = sync.push(state, v0 + 1)                 # nothing was sent: the group is still in step
    assert res.version == v0 + 1
    assert_serves(client, policy, v0 + 1)


def test_sharded_trainer_ranks_each_send_their_part(client, policy):
    perturb(policy, seed=13)
    state = policy.state_dict()
    names = list(state)
    parts = [{n: state[n] for n in names[0::2]}, {n: state[n] for n in names[1::2]}]
    port = _free_port("127.0.0.1")
    ranks = [WeightSync(client, master_port=port, ranks=2, timeout_s=20), WeightSync(None, master_port=port, rank=1,
                                                                                      ranks=2, timeout_s=20)]
    v = next_version(client)
    out: dict = {}

    def run(r):
        try:
            ranks[r].connect(timeout=60)
            out[r] = ranks[r].push(parts[r], v)
        except BaseException as e:  # noqa: BLE001 - reported below
            out[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert out[1] is None and not isinstance(out[0], BaseException), out
    assert out[0].version == v and client.status().weight_transfer.world_size == 3
    assert_serves(client, policy, v)
    ranks[1].close()
    ranks[0].close()
    assert not client.status().weight_transfer.joined


def test_a_trainer_that_never_joins_fails_the_setup_within_its_timeout(client):
    v0 = client.status().policy_version
    stream = client.stub.InitWeightTransfer(pb.WeightTransferInit(
        master_address="127.0.0.1", master_port=_free_port("127.0.0.1"), timeout_s=3), metadata=client.auth.admin())
    shape = next(stream)
    assert shape.world_size == 2 and not shape.joined
    t = time.monotonic()
    code, msg = code_of(lambda: next(stream))                     # nobody hosts the rendezvous
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "trainer rank" in msg, msg
    assert time.monotonic() - t < 30
    st = client.status()
    assert st.ready and st.policy_version == v0 and not st.weight_transfer.joined
    code, msg = code_of(lambda: next(client.stub.TransferWeights(pb.TransferRequest(version=v0 + 1),
                                                               metadata=client.auth.admin())))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitWeightTransfer" in msg


def test_a_trainer_that_dies_mid_push_leaves_the_last_version_serving(client, policy):
    """The engines are receiving and the trainer's side of the group goes away: they give up within the group's
    timeout, the push fails naming it, nothing changed, the group is closed; a new group then works."""
    sync = WeightSync(client, timeout_s=5)
    sync.connect(timeout=60)
    v0 = client.status().policy_version
    state = {k: v + 1.0 for k, v in policy.state_dict().items()}
    call = client.stub.TransferWeights(transfer_request(sync, state, v0 + 1), metadata=client.auth.admin())
    assert next(call).WhichOneof("item") == "ready"
    sync.pg.shutdown()                                            # the trainer is gone before it sent
    t = time.monotonic()
    code, msg = code_of(lambda: next(call))
    assert code in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED) and "closed" in msg, msg
    assert time.monotonic() - t < 60
    st = client.status()
    assert st.ready and st.policy_version == v0 and not st.weight_transfer.joined
    assert_serves(client, policy, v0)
    again = WeightSync(client, timeout_s=20)
    again.connect(timeout=60)
    perturb(policy, seed=14)
    assert again.push(policy, v0 + 1).version == v0 + 1
    assert_serves(client, policy, v0 + 1)
    again.close()


def test_one_transfer_at_a_time(client, policy, sync):
    """A second push (or a new set-up) while one is in flight is refused; the first one commits."""
    v0 = client.status().policy_version
    state = policy.state_dict()
    call = client.stub.TransferWeights(transfer_request(sync, state, v0 + 1), metadata=client.auth.admin())
    assert next(call).WhichOneof("item") == "ready"
    code, msg = code_of(lambda: next(client.stub.TransferWeights(transfer_request(sync, state, v0 + 2),
                                                               metadata=client.auth.admin())))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "in flight" in msg
    code, msg = code_of(lambda: client.stub.CloseWeightTransfer(pb.CloseWeightTransferRequest(),
                                                                metadata=client.auth.admin()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "in flight" in msg
    send(sync.pg, [t for _, t in tensors_of(state)], 0, sync.buffer_bytes)
    assert next(call).result.version == v0 + 1


def test_metrics_report_the_transfer_path(service, sync):
    status, body = service.http_get("/metrics")
    assert status == 200
    assert 'rollout_weight_pushes_total{outcome="committed",path="transfer"}' in body
    assert "rollout_weight_push_gb_per_second{path=\"transfer\"}" in body
    assert "rollout_weight_transfer_world_size 2.0" in body


# ---- vLLM's weight-transfer endpoints, driven by TRL's own client ----------------------------------------------
def test_chunks_follow_vllms_packing_rule():
    """rollout_client.transfer.chunks cuts exactly where vLLM's pack_tensors does (both sides of the group cut
    from the metadata alone, so a difference would misplace every byte after it)."""
    from rollout_client.transfer import chunks
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    g = torch.Generator().manual_seed(0)
    for buffer_bytes in (1, 7, 64, 100, 1000):
        sizes = torch.randint(1, 120, (40,), generator=g).tolist()
        items = iter([(str(i), torch.zeros(s, dtype=torch.uint8)) for i, s in enumerate(sizes)])
        theirs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")              # "tensor exceeds buffer_size_bytes": on purpose
            while (chunk := pack_tensors(items, lambda item: item[1], buffer_bytes)) is not None:
                theirs.append([int(n) for n in chunk.names])
        assert chunks(sizes, buffer_bytes) == theirs, buffer_bytes


def test_trl_weight_transfer_client_over_the_vllm_dialect(service, client, policy, monkeypatch):
    """TRL's async GRPO weight sync (trl.experimental.async_grpo: WeightTransferClient + VLLMClient, TRL 1.16.0)
    unchanged against the service's vLLM dialect (/get_world_size, /server_info, /init_weight_transfer_engine,
    /pause?mode=keep, /start_weight_update, /update_weights {"update_info"}, /finish_weight_update, /resume),
    with only its two NCCL pieces replaced by their gloo equivalents (the CPU engines use the gloo backend):
    the trainer's endpoint and the packed broadcast (rollout_client.trl_gloo.use_gloo). Two syncs, each then
    served. TRL comes with scripts/install.sh (trl==1.16.0); the test skips without it."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # TRL hosts the group at vLLM's get_ip(): this machine's
    # loopback (its outward address is refused for a loopback caller: security.weight_transfer_hosts)
    wt = pytest.importorskip("trl.experimental.async_grpo.weight_transfer")
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()                                   # TRL logs through accelerate's logger
    endpoints = use_gloo(wt, monkeypatch.setattr)

    params = [(n, p.detach()) for n, p in policy.named_parameters()]
    info = {"names": [n for n, _ in params], "dtype_names": [str(p.dtype).split(".")[-1] for _, p in params],
            "shapes": [list(p.shape) for _, p in params]}
    vllm = VLLMClient(service.http, server_timeout=30)
    assert vllm.get_dtype() == "torch.float32" and vllm.get_world_size() == 1
    trl_client = wt.WeightTransferClient(vllm, info, weight_sync_timeout=120)
    trl_client.init_weight_transfer()
    g = client.status().weight_transfer
    assert g.joined and g.world_size == 2 and g.buffer_bytes == 1 << 30 and [e.rank_offset for e in g.engines] == [1]
    try:
        for seed in (21, 22):
            perturb(policy, seed=seed)
            v = client.status().policy_version + 1
            trl_client.pause()
            trl_client.send_weights(iter([(n, p.detach()) for n, p in policy.named_parameters()]))
            assert client.status().policy_version == v      # committed before /update_weights answered
            trl_client.resume()
            assert_serves(client, policy, v)
        assert endpoints[0].sent[-1] == sum(p.numel() * p.element_size() for _, p in params)
        with httpx.Client(base_url=service.http, timeout=30) as http:
            assert http.get("/weight_info").json() == {"weight_version": str(v)}
            assert http.post("/finish_weight_update").status_code == 409          # no update open
    finally:
        trl_client.destroy()
        with httpx.Client(base_url=service.http, timeout=30) as http:
            assert http.post("/shutdown_weight_transfer_engine").status_code == 200
        endpoints[0].close()
    assert not client.status().weight_transfer.joined
