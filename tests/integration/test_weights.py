"""Weight pushes on a real engine: new weights serve (checked against an independent forward pass),
in-flight modes, failures that leave the old version serving, version ordering, LoadWeights."""
import copy
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from rollout_client import RolloutClient
from rollout_client.weights import push_stream

from rollout_service.api import pb
from rollout_service.drafting.reference import processed_logprobs
from tests.integration.services import wait_for

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]


def next_version(client) -> int:
    return client.status().policy_version + 1


def perturb(model, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())


def assert_serves(client, model, version: int, temperature=1.0, top_k=0, top_p=1.0):
    groups = client.generate_all(PROMPTS, n=2, max_tokens=10, ignore_eos=True, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=5)
    for p, group in enumerate(groups):
        for s in group:
            assert s.policy_version == version and s.version_spans == [(version, 0)]
            ref = processed_logprobs(model, PROMPTS[p], s.token_ids.tolist(), temperature, top_k, top_p)
            np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-3, rtol=0)


def test_full_push_serves_the_new_weights(client, policy):
    perturb(policy, seed=1)
    v = next_version(client)
    res = client.push_weights(policy, v)
    assert res.version == v and res.target == "policy" and not res.partial
    assert res.num_tensors == len(policy.state_dict()) and res.num_bytes > 0
    assert res.total_s >= res.pause_s > 0 and res.apply_s > 0
    st = client.status()
    assert st.policy_version == v and all(e.policy_version == v for e in st.engines)
    assert_serves(client, policy, v, temperature=0.8, top_k=50)


def test_partial_push_replaces_only_what_it_carries(client, policy):
    with torch.no_grad():
        policy.model.norm.weight.mul_(1.5)
        policy.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
    part = {"model.norm.weight": policy.model.norm.weight,
            "model.layers.1.mlp.down_proj.weight": policy.model.layers[1].mlp.down_proj.weight}
    v = next_version(client)
    res = client.push_weights(part, v, partial=True, chunk_bytes=1000)     # many small chunks per tensor
    assert res.partial and res.num_tensors == 2
    assert_serves(client, policy, v)


def test_versions_must_increase(client, policy):
    v = client.status().policy_version
    for bad in (v, v - 1):
        with pytest.raises(grpc.RpcError) as e:
            client.push_weights({"model.norm.weight": policy.model.norm.weight}, bad, partial=True)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in e.value.details()
    assert client.status().policy_version == v


def _push_raw(client, messages):
    return client.stub.PushWeights(iter(messages))


def _corrupt(policy, version, how):
    trailer = how.startswith("trailer")
    msgs = list(push_stream({"model.norm.weight": policy.model.norm.weight, "lm_head.weight": policy.lm_head.weight},
                            version, target=pb.TARGET_POLICY, partial=True,
                            checksum="trailer" if trailer else "header", pack_bytes=0))   # chunks[0].chunk: a tensor
    if how == "trailer_checksum":
        msgs[-1].trailer.sha256 = "0" * 64
    elif how == "trailer_missing":
        msgs = msgs[:-1]
    elif how == "trailer_not_last":
        msgs = msgs[:-2] + [msgs[-1], msgs[-2]]
    if trailer:
        return msgs
    header, chunks = msgs[0], msgs[1:]
    if how == "name":
        chunks[0].chunk.name = "model.not_a_layer.weight"
    elif how == "shape":
        chunks[0].chunk.shape[:] = [7, 7]
    elif how == "dtype":
        chunks[0].chunk.dtype = "int8"
    elif how == "checksum":
        header.header.sha256 = "0" * 64
    elif how == "truncated":
        chunks = chunks[:-1]
    elif how == "no_header":
        return chunks
    elif how == "two_headers":
        chunks = [header] + chunks
    elif how == "not_partial":
        header.header.partial = False
    return [header] + chunks


@pytest.mark.parametrize("how,code,needle", [
    ("name", grpc.StatusCode.INVALID_ARGUMENT, "model.not_a_layer.weight"),
    ("shape", grpc.StatusCode.INVALID_ARGUMENT, "shape [7, 7]"),
    ("dtype", grpc.StatusCode.INVALID_ARGUMENT, "dtype 'int8'"),
    ("checksum", grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch"),
    ("truncated", grpc.StatusCode.INVALID_ARGUMENT, "cut short"),
    ("no_header", grpc.StatusCode.INVALID_ARGUMENT, "first message must carry the header"),
    ("two_headers", grpc.StatusCode.INVALID_ARGUMENT, "only the first message"),
    ("not_partial", grpc.StatusCode.INVALID_ARGUMENT, "tensors are missing"),
    ("trailer_checksum", grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch"),
    ("trailer_missing", grpc.StatusCode.INVALID_ARGUMENT, "no sha256"),
    ("trailer_not_last", grpc.StatusCode.INVALID_ARGUMENT, "trailer must be the last message"),
])
def test_bad_push_changes_nothing(service, client, policy, how, code, needle):
    before = client.status().policy_version
    with pytest.raises(grpc.RpcError) as e:
        _push_raw(client, _corrupt(policy, before + 1, how))
    assert e.value.code() == code and needle in e.value.details(), e.value.details()
    assert client.status().policy_version == before
    assert not staged_files(service), "a rejected push leaves no staging file behind"
    assert_serves(client, policy, before)


def staged_files(service) -> list:
    """Staging files the server holds outside its committed state (weights/scratch.scratch_root)."""
    from pathlib import Path

    return [p for base in (Path("/dev/shm"), Path(tempfile.gettempdir()))
            for p in (base / f"rollout-service-{service.proc.pid}").glob("*.safetensors")]


def test_stream_cut_mid_way_changes_nothing(service, client, policy):
    before = client.status().policy_version
    msgs = list(push_stream(policy, before + 1, target=pb.TARGET_POLICY, chunk_bytes=1 << 16))

    def dies_half_way():
        for i, m in enumerate(msgs):
            if i == len(msgs) // 2:
                raise RuntimeError("trainer crashed mid-push")
            yield m

    with pytest.raises(grpc.RpcError) as e:
        client.stub.PushWeights(dies_half_way())
    assert e.value.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
    assert client.status().policy_version == before
    wait_for(lambda: not staged_files(service), 10, "the cut push's staging file to be removed")
    assert_serves(client, policy, before)


def _stream_in_background(client, max_tokens, out, **kw):
    def run():
        try:
            out["samples"] = list(client.generate(PROMPTS, n=2, max_tokens=max_tokens, ignore_eos=True, seed=9, **kw))
        except grpc.RpcError as e:
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 20
    while client.status().queue_depth < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)   # a few tokens in
    return t


def test_abort_mode_ends_in_flight_requests_with_aborted(client, policy):
    out = {}
    t = _stream_in_background(client, 400, out)
    perturb(policy, seed=2)
    v = next_version(client)
    client.push_weights(policy, v, mode="abort")
    t.join(60)
    assert "error" in out and out["error"].code() == grpc.StatusCode.ABORTED
    assert "retry" in out["error"].details()
    assert_serves(client, policy, v)


def test_abort_mode_returns_partial_samples_that_continue_under_the_new_version(client, policy, tiny_model):
    """return_partial: the abort ends each in-flight sample as it stands (FINISH_REASON_ABORT, the old policy's
    tokens and log-probs); each continues (Prompt.partial) under the new weights into ONE sample of max_tokens:
    the partial first, version spans old then new, the new part's log-probs the new policy's on the whole prefix."""
    from transformers import AutoTokenizer

    old_model = copy.deepcopy(policy)
    out = {}
    old = client.status().policy_version
    t = _stream_in_background(client, 400, out, return_partial=True, temperature=0.9)
    perturb(policy, seed=6)
    v = old + 1
    client.push_weights(policy, v, mode="abort")
    t.join(60)
    assert "error" not in out and len(out["samples"]) == 4
    parts = out["samples"]
    assert all(s.finish_reason == "abort" and len(s.token_ids) < 400 for s in parts)
    assert sum(len(s.token_ids) for s in parts) > 0, "the abort came before any token: nothing to continue"
    for s in parts:
        if len(s.token_ids):
            assert s.version_spans == [(old, 0)]
            ref = processed_logprobs(old_model, PROMPTS[s.prompt_index], s.token_ids.tolist(), 0.9, 0, 1.0)
            np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-3, rtol=0)

    prompts = [PROMPTS[s.prompt_index] for s in parts]
    done = [g[0] for g in client.generate_all(prompts, partials=parts, max_tokens=400, ignore_eos=True,
                                              temperature=0.9, seed=10, return_text=True)]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for part, s, prompt in zip(parts, done, prompts):
        n = len(part.token_ids)
        assert len(s.token_ids) == 400 and s.finish_reason == "length" and s.num_prompt_tokens == len(prompt)
        assert s.token_ids[:n].tolist() == part.token_ids.tolist() and np.array_equal(s.logprobs[:n], part.logprobs)
        assert s.version_spans == ([(old, 0), (v, n)] if n else [(v, 0)]) and s.policy_version == (old if n else v)
        new = processed_logprobs(policy, prompt, s.token_ids.tolist(), 0.9, 0, 1.0)[n:]
        np.testing.assert_allclose(s.logprobs[n:], new.numpy(), atol=2e-3, rtol=0)
        assert s.text == tok.decode(s.token_ids.tolist(), skip_special_tokens=True)   # the whole sample's text
    with pytest.raises(grpc.RpcError) as e:
        client.generate_all(prompts[:1], partials=parts[:1], max_tokens=len(parts[0].token_ids))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompts[0].partial.token_ids" in e.value.details()


def test_wait_mode_lets_in_flight_finish_on_the_old_version(client, policy):
    out = {}
    old = client.status().policy_version
    t = _stream_in_background(client, 120, out)
    perturb(policy, seed=3)
    v = old + 1
    client.push_weights(policy, v, mode="wait")
    t.join(60)
    assert "error" not in out and len(out["samples"]) == 4
    assert all(s.version_spans == [(old, 0)] and len(s.token_ids) == 120 for s in out["samples"])
    assert_serves(client, policy, v)


def test_keep_mode_continues_in_flight_under_the_new_version(client, policy):
    out = {}
    old = client.status().policy_version
    t = _stream_in_background(client, 300, out)
    perturb(policy, seed=4)
    v = old + 1
    res = client.push_weights(policy, v, mode="keep")
    t.join(120)
    assert "error" not in out and len(out["samples"]) == 4
    for s in out["samples"]:
        assert len(s.token_ids) == 300
        assert [sp[0] for sp in s.version_spans] == [old, v], s.version_spans
        assert 0 < s.version_spans[1][1] < 300
    assert res.pause_s < 30
    assert_serves(client, policy, v)


def test_load_weights_from_a_path(client, policy, tmp_path):
    from safetensors.torch import save_file

    perturb(policy, seed=5)
    save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, str(tmp_path / "model.safetensors"))
    v = next_version(client)
    res = client.load_weights(str(tmp_path), v)
    assert res.version == v and res.num_tensors == len(policy.state_dict())
    assert_serves(client, policy, v)
    with pytest.raises(grpc.RpcError) as e:
        client.load_weights(str(tmp_path / "nope"), v + 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in e.value.details()
    assert client.status().policy_version == v


def test_load_weights_reads_only_regular_files_inside_the_roots(client, tmp_path):
    """A FIFO named *.safetensors is refused naming it (reading it would hold the server forever); paths
    outside --weights-root are PERMISSION_DENIED naming the option; nothing changes, the service answers."""
    import os

    before = client.status().policy_version
    os.mkfifo(tmp_path / "x.safetensors")
    with pytest.raises(grpc.RpcError) as e:
        client.load_weights(str(tmp_path), before + 1, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x.safetensors" in e.value.details()
    assert "FIFO" in e.value.details()
    os.symlink("/etc/hostname", tmp_path / "y.safetensors")
    for path in ("/etc/hostname", "/dev/zero", str(tmp_path / "y.safetensors")):
        with pytest.raises(grpc.RpcError) as e:
            client.load_weights(path, before + 1, timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, path
        assert "--weights-root" in e.value.details()
    assert client.status().policy_version == before
    assert len(client.generate_all([[1, 2, 3]], max_tokens=2)[0]) == 1


def test_concurrent_pushes_are_serialized(client, policy):
    base = client.status().policy_version
    results, errors = [], []
    part = {"model.norm.weight": policy.model.norm.weight}

    def push(v):
        try:
            with RolloutClient(client_target(client)) as c:
                results.append(c.push_weights(part, v, partial=True).version)
        except grpc.RpcError as e:
            errors.append(e)

    threads = [threading.Thread(target=push, args=(base + i,)) for i in (1, 2, 3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert all(e.code() == grpc.StatusCode.FAILED_PRECONDITION for e in errors)
    assert base + 3 in results or client.status().policy_version == max(results)
    assert client.status().policy_version == max(results)
    assert_serves(client, policy, client.status().policy_version)


def test_update_draft_without_a_drafter_is_failed_precondition(client, policy):
    with pytest.raises(grpc.RpcError) as e:
        client.update_draft({"model.norm.weight": policy.model.norm.weight}, 1, partial=True)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no drafter" in e.value.details()


def client_target(client) -> str:
    return client._target
