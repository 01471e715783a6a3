"""LoRA adapters as policies, bookkeeping only (FakeEngines): the PEFT config and tensor checks, commits on every
engine or none, each name's version line, the versions kept loaded (samples in flight finish on theirs), the limits,
admission by policy name and version, restarts loading every adapter, adapters kept across a server restart with a
state_dir (and a server killed at each phase of an adapter commit). Tokens and log-probs against a merged forward
pass are tests/integration/test_lora.py's."""
import asyncio
import functools
import json
import math

import grpc
import pytest
import torch
from rollout_client.weights import push_stream
from safetensors.torch import save_file

from rollout_service.api import pb
from rollout_service.config import LoraConfig
from rollout_service.errors import ServiceError
from rollout_service.faults import ADAPTER_COMMIT_POINTS
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.scratch import scratch_root
from rollout_service.server.service import RolloutService
from rollout_service.validation import Limits
from rollout_service.weights.adapters import PREFIX, parse_config
from rollout_service.weights.manifest import read_manifest
from rollout_service.weights.service import Chunk, Header, Trailer, WeightService
from tests.fake_engine import FakeEngine
from tests.unit.conftest import push_then_crash, run_until_killed

H, INTER = 6, 10           # hidden and intermediate sizes of the fake decoder layer
BASE = {"model.embed_tokens.weight": torch.zeros(50, H), "lm_head.weight": torch.zeros(50, H),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(H, H),
        "model.layers.0.self_attn.v_proj.weight": torch.zeros(2, H),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(H, INTER),
        "model.layers.0.input_layernorm.weight": torch.ones(H)}
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
          "bias": "none"}


def adapter(r=4, seed=0, modules=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        w = BASE[f"model.layers.0.{m}.weight"]
        out[f"{PREFIX}model.layers.0.{m}.lora_A.weight"] = torch.randn(r, w.shape[1], generator=g)
        out[f"{PREFIX}model.layers.0.{m}.lora_B.weight"] = torch.randn(w.shape[0], r, generator=g)
    return out


def sync(test):
    """Run an async test in its own event loop (the unit suite has no asyncio plugin)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return run


def write_base(d):
    """The fake base model's checkpoint in directory `d` (created)."""
    d.mkdir()
    save_file(BASE, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def ckpt(tmp_path):
    return write_base(tmp_path / "base")


def manifest(ckpt):
    return read_manifest(ckpt, "float32")


async def make(ckpt, engines=2, state_dir="", **lora):
    pool = EnginePool([FakeEngine(f"e{i}", vocab_size=50, step_s=0.002) for i in range(engines)], max_queue=64,
                      checkpoints={"policy": ckpt}, lora=LoraConfig(**({"max_adapters": 2} | lora)),
                      state_dir=state_dir)
    await pool.start()
    weights = WeightService.create(pool, "float32", weights_roots=[str(ckpt.parent)])
    model = ModelInfo(path=str(ckpt), vocab_size=50, max_model_len=256, tokenizer=None)
    return pool, weights, RolloutService(pool, model, Limits(8, 8), weights, None)


async def push(weights, name, version, tensors=None, config=None, **kw):
    msgs = list(push_stream(tensors if tensors is not None else adapter(seed=version), version,
                            target=pb.TARGET_ADAPTER, chunk_bytes=64, adapter=name,
                            adapter_config=json.dumps(config or CONFIG), pack_bytes=0))     # a TensorChunk per message
    h = msgs[0].header
    header = Header(h.version, "adapter", h.total_bytes, h.sha256, "wait", h.partial, h.adapter, h.adapter_config)

    async def chunks():
        for m in msgs[1:]:
            if m.WhichOneof("item") == "trailer":
                yield Trailer(m.trailer.sha256)
            else:
                c = m.chunk
                yield Chunk(c.name, c.dtype, tuple(c.shape), c.offset, c.data)
    return await weights.push(header, chunks(), **kw)


def request(policy="", version=0, n=2, max_tokens=8, **kw):
    return pb.GenerateRequest(prompts=[pb.Prompt(token_ids=[1, 2, 3])], n=n, policy=policy, policy_version=version,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=1.0), **kw)


async def samples(service, req):
    _, rec = await service.admit(req)
    return [item.result async for item in rec.read()]


# ---- the PEFT config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, words", [
    ({"r": 32}, "exceeds the server's engine.lora.max_rank=16"),
    ({"r": 0}, "positive integer"),
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"target_modules": ["nothing_here"]}, "match no linear module"),
    ({"target_modules": ["lm_head"]}, "only linear modules of the decoder layers"),
    ({"peft_type": "IA3"}, "only LORA"),
])
def test_config_refusals_name_the_field(ckpt, change, words):
    with pytest.raises(ServiceError) as e:
        parse_config(json.dumps(CONFIG | change), manifest(ckpt), 16, "header.adapter_config")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.message and "header.adapter_config" in e.value.message


def test_config_gives_every_tensor_shape(ckpt):
    spec = parse_config(json.dumps(CONFIG), manifest(ckpt), 16, "f")
    shapes = {n: s.shape for n, s in spec.manifest.tensors.items()}
    assert shapes == {n: tuple(t.shape) for n, t in adapter().items()}
    assert spec.target_modules == ["down_proj", "q_proj", "v_proj"] and spec.rank == 4
    regex = parse_config(json.dumps(CONFIG | {"target_modules": r".*\.q_proj"}), manifest(ckpt), 16, "f")
    assert regex.modules == ["model.layers.0.self_attn.q_proj"]


# ---- commits ----------------------------------------------------------------------------------------------
@sync
async def test_push_commits_on_every_engine_and_samples_carry_the_adapter_version(ckpt):
    pool, weights, service = await make(ckpt)
    out = await push(weights, "alice", 1)
    assert (out.target, out.version, out.adapter, out.num_tensors) == ("adapter", 1, "alice", 6)
    ids = [set(e.adapters) for e in pool.engines]
    assert ids[0] == ids[1] and len(ids[0]) == 1
    got = await samples(service, request("alice"))
    assert [r.version_spans for r in got] == [[(1, 0)], [(1, 0)]] and all(r.policy_version == 1 for r in got)
    assert all(s.lora_id == next(iter(ids[0])) and s.lora_name == "alice@v1" for e in pool.engines for s in e.seen)
    base = await samples(service, request(""))
    assert all(r.version_spans == [(0, 0)] for r in base)
    a = pool.adapters.adapters["alice"]
    assert (a.samples_total, a.running) == (2, 0)


@sync
async def test_versions_strictly_increase_per_name_and_names_are_independent(ckpt):
    pool, weights, _ = await make(ckpt)
    await push(weights, "alice", 3)
    with pytest.raises(ServiceError) as e:
        await push(weights, "alice", 3)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "not newer than its latest version 3" in str(e.value)
    await push(weights, "bob", 1)                      # bob's line starts on its own
    assert {n: a.latest for n, a in pool.adapters.adapters.items()} == {"alice": 3, "bob": 1}


@sync
async def test_a_failed_load_on_one_engine_changes_nothing(ckpt):
    pool, weights, service = await make(ckpt)
    await push(weights, "alice", 1)
    before = [dict(e.adapters) for e in pool.engines]
    pool.engines[1].fail_adapter = 1
    with pytest.raises(ServiceError) as e:
        await push(weights, "alice", 2)
    assert e.value.code == grpc.StatusCode.INTERNAL and "version 1 still serves" in str(e.value)
    assert [dict(e.adapters) for e in pool.engines] == before     # removed from the engine that had loaded it
    assert pool.adapters.adapters["alice"].latest == 1
    assert not (pool.adapters.folder("alice", 2)).exists()
    got = await samples(service, request("alice"))
    assert all(r.version_spans == [(1, 0)] for r in got)


@sync
async def test_an_engine_dying_during_an_adapter_commit_fails_it_retriable_and_releases_the_push_lock(ckpt):
    """vLLM never answers add_lora sent to an engine core that then died: the commit held the push lock for good and
    the supervisor, which restarts the engine under it, waited behind it (found by bench/soak.py)."""
    pool, weights, service = await make(ckpt)
    await push(weights, "alice", 1)
    e1 = pool.engines[1]
    e1.add_adapter = e1.dies_unanswered()
    with pytest.raises(ServiceError) as e:
        await asyncio.wait_for(push(weights, "alice", 2), 10)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "version 1 still serves" in str(e.value)
    assert not pool.push_lock.locked()
    assert pool.adapters.adapters["alice"].latest == 1
    assert [dict(x.adapters) for x in pool.engines][0] == {1: "alice@v1"}     # engine 0 unloaded version 2 again


@sync
async def test_limits_count_rank_and_bytes(ckpt):
    pool, weights, _ = await make(ckpt, max_adapters=1, max_adapter_mb=0.0005)
    with pytest.raises(ServiceError) as e:                        # 6 tensors of float32: ~700 bytes > 524
        await push(weights, "alice", 1)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_adapter_mb" in str(e.value)
    pool.adapters.cfg.max_adapter_mb = 1.0
    await push(weights, "alice", 1)
    with pytest.raises(ServiceError) as e:
        await push(weights, "bob", 1)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_adapters=1" in str(e.value)
    with pytest.raises(ServiceError) as e:                        # a tensor the config does not list
        await push(weights, "alice", 2, tensors=adapter() | {"extra.lora_A.weight": torch.zeros(2, 2)})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "extra.lora_A.weight" in str(e.value)
    with pytest.raises(ServiceError) as e:                        # lora_B of the wrong rank
        await push(weights, "alice", 2, tensors=adapter(r=3))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "shape" in str(e.value)
    with pytest.raises(ServiceError) as e:
        await push(weights, "bad/name", 2)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "header.adapter" in str(e.value)
    assert [set(e.adapters.values()) for e in pool.engines] == [{"alice@v1"}] * 2


@sync
async def test_last_versions_kept_and_in_flight_samples_finish_on_theirs(ckpt):
    pool, weights, service = await make(ckpt, versions_kept=2)
    await push(weights, "alice", 1)
    for e in pool.engines:
        e.step_s = 0.03                       # the sample on version 1 runs ~1.8 s: over both pushes below
    _, running = await service.admit(request("alice", max_tokens=60, n=1))
    await asyncio.sleep(0.02)
    await push(weights, "alice", 2)
    await push(weights, "alice", 3)                                   # version 1 retired, still running
    assert sorted(pool.adapters.adapters["alice"].versions) == [1, 2, 3]
    with pytest.raises(ServiceError) as e:                            # evicted: no new request
        await service.admit(request("alice", version=1))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "evicted" in str(e.value) and "policy_version" in str(e.value)
    with pytest.raises(ServiceError) as e:
        await service.admit(request("alice", version=9))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    got = [item.result async for item in running.read()]
    assert got[0].version_spans == [(1, 0)] and len(got[0].token_ids) == 60      # finished on version 1
    for _ in range(500):                                             # then unloaded from every engine
        if 1 not in pool.adapters.adapters["alice"].versions:
            break
        await asyncio.sleep(0.01)
    assert sorted(pool.adapters.adapters["alice"].versions) == [2, 3]
    assert [sorted(e.adapters.values()) for e in pool.engines] == [["alice@v2", "alice@v3"]] * 2
    assert not pool.adapters.folder("alice", 1).exists()
    got = await samples(service, request("alice", version=2, max_tokens=2))
    assert all(r.version_spans == [(2, 0)] for r in got)


@sync
async def test_unknown_adapter_and_unload(ckpt):
    pool, weights, service = await make(ckpt)
    with pytest.raises(ServiceError) as e:
        await service.admit(request("nobody"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "policy" in str(e.value)
    await push(weights, "alice", 1)
    status = await service.unload_adapter("alice")
    assert status.name == "alice" and list(status.loaded_versions) == [1]
    assert all(not e.adapters for e in pool.engines) and not pool.adapters.adapters
    with pytest.raises(ServiceError) as e:
        await service.admit(request("alice"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ServiceError) as e:
        await service.unload_adapter("alice")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    await push(weights, "alice", 1)                                # a new line after an unload
    assert pool.adapters.adapters["alice"].latest == 1


@sync
async def test_an_engine_dying_while_an_adapter_unloads_releases_the_push_lock(ckpt):
    """The same unanswered call on the pool's side (bench/soak.py's second run wedged there): unloading an adapter
    from an engine that died meanwhile gives up on that engine, so the lock is free for the supervisor's restart."""
    pool, weights, service = await make(ckpt)
    await push(weights, "alice", 1)
    e1 = pool.engines[1]
    e1.remove_adapter = e1.dies_unanswered()
    status = await asyncio.wait_for(service.unload_adapter("alice"), 10)
    assert status.name == "alice" and not pool.push_lock.locked()
    assert not pool.engines[0].adapters and not pool.adapters.adapters


@sync
async def test_lora_off_refuses_pushes_and_requests(ckpt):
    pool, weights, service = await make(ckpt, max_adapters=0)
    with pytest.raises(ServiceError) as e:
        await push(weights, "alice", 1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--max-adapters" in str(e.value)
    with pytest.raises(ServiceError) as e:
        await service.admit(request("alice"))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "max_adapters" in str(e.value)


@sync
async def test_partial_continues_on_its_adapter_only(ckpt):
    pool, weights, service = await make(ckpt)
    await push(weights, "alice", 1)
    await push(weights, "alice", 2)
    part = pb.PartialSample(token_ids=[5, 6], logprobs=[-1.0, -1.0], policy="alice",
                            version_spans=[pb.VersionSpan(policy_version=1, first_token=0)])
    req = request("alice", n=1)
    req.prompts[0].partial.CopyFrom(part)
    got = await samples(service, req)
    assert got[0].token_ids[:2] == [5, 6] and got[0].version_spans == [(1, 0), (2, 2)]
    other = request("", n=1)
    other.prompts[0].partial.CopyFrom(part)
    with pytest.raises(ServiceError) as e:
        await service.admit(other)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompts[0].partial.policy" in str(e.value)


@sync
async def test_a_restarted_engine_loads_every_adapter_version(ckpt):
    pool, weights, service = await make(ckpt)
    await push(weights, "alice", 1)
    await push(weights, "bob", 4)
    e1 = pool.engines[1]
    assert await pool.restart_at_committed(e1)
    assert sorted(e1.adapters.values()) == ["alice@v1", "bob@v4"]


@sync
async def test_load_adapter_from_a_peft_directory(ckpt):
    pool, weights, service = await make(ckpt)
    d = ckpt.parent / "peft-dir"
    d.mkdir()
    save_file(adapter(seed=5), str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(CONFIG))
    out = await weights.load(str(d), 2, "adapter", "wait", False, adapter="carol")
    assert (out.version, out.adapter, out.num_tensors) == (2, "carol", 6)
    assert all("carol@v2" in e.adapters.values() for e in pool.engines)
    (d / "adapter_config.json").write_text(json.dumps(CONFIG | {"r": 2}))     # tensors of rank 4
    with pytest.raises(ServiceError) as e:
        await weights.load(str(d), 3, "adapter", "wait", False, adapter="carol")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "shape" in str(e.value)
    assert pool.adapters.adapters["carol"].latest == 2


# ---- kept across a restart (a state_dir) ---------------------------------------------------------------------
@sync
async def test_a_new_server_on_the_state_dir_serves_the_committed_adapters(ckpt, tmp_path):
    state = tmp_path / "state"
    pool, weights, service = await make(ckpt, state_dir=state, versions_kept=2)
    for v in (1, 2, 3):
        await push(weights, "alice", v, tenant="team-a")
    await push(weights, "bob", 5)
    status = await service.unload_adapter("bob")                 # durable at once: bob does not come back
    assert status.name == "bob"
    assert not pool.adapters.folder("alice", 1).exists()

    again, weights2, service2 = await make(ckpt, state_dir=state, versions_kept=2)
    a = again.adapters.adapters["alice"]
    assert (a.latest, sorted(a.versions), a.tenant) == (3, [2, 3], "team-a")
    assert set(again.adapters.adapters) == {"alice"} and again.adapters.restored == {"alice": [2, 3]}
    assert [sorted(e.adapters.values()) for e in again.engines] == [["alice@v2", "alice@v3"]] * 2
    got = await samples(service2, request("alice"))
    assert [r.version_spans for r in got] == [[(3, 0)]] * 2
    got = await samples(service2, request("alice", version=2))
    assert [r.version_spans for r in got] == [[(2, 0)]] * 2
    assert sorted(p.name for p in (state / "adapters").iterdir()) == ["alice"]
    with pytest.raises(ServiceError) as e:                        # versions still increase after the restart
        await push(weights2, "alice", 3)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    await push(weights2, "alice", 4)
    third, _, _ = await make(ckpt, state_dir=state, versions_kept=2)
    assert sorted(third.adapters.adapters["alice"].versions) == [3, 4]
    assert sorted(p.name for p in (state / "adapters" / "alice").iterdir()) == ["v3", "v4"]


@sync
async def test_without_a_state_dir_a_new_server_serves_no_adapter(ckpt):
    pool, weights, _ = await make(ckpt)
    await push(weights, "alice", 1)
    again, _, service = await make(ckpt)
    assert not again.adapters.adapters and not again.adapters.restored
    with pytest.raises(ServiceError) as e:
        await service.admit(request("alice"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND


@sync
async def test_recorded_adapters_this_server_cannot_serve_are_refused_naming_why(ckpt, tmp_path):
    from rollout_service.config import ConfigError

    state = tmp_path / "state"
    _, weights, _ = await make(ckpt, state_dir=state, max_rank=8)
    await push(weights, "alice", 1)
    await push(weights, "bob", 1)
    for lora, words in (({"max_adapters": 0}, "--max-adapters 2"), ({"max_adapters": 1}, "--max-adapters 2"),
                        ({"max_rank": 2}, "--max-lora-rank 4")):
        with pytest.raises(ConfigError) as e:
            await make(ckpt, state_dir=state, **lora)
        assert words in str(e.value) and str(state / "adapters.json") in str(e.value), str(e.value)
    (ckpt / "config.json").write_text('{"hidden_size": 6}')           # another base model in the same place
    with pytest.raises(ConfigError) as e:
        await make(ckpt, state_dir=state)
    assert "another base model" in str(e.value)


@sync
async def test_an_adapter_commit_whose_record_cannot_be_written_changes_nothing(ckpt, tmp_path, monkeypatch):
    pool, weights, service = await make(ckpt, state_dir=tmp_path / "state")
    await push(weights, "alice", 1)

    def full(record):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pool.adapters, "save", full)
    with pytest.raises(ServiceError) as e:
        await push(weights, "alice", 2)
    assert e.value.code == grpc.StatusCode.INTERNAL and "No space left" in str(e.value)
    assert "version 1 still serves" in str(e.value)
    assert [sorted(e.adapters.values()) for e in pool.engines] == [["alice@v1"]] * 2
    assert pool.adapters.adapters["alice"].latest == 1 and not pool.adapters.folder("alice", 2).exists()
    with pytest.raises(ServiceError) as e:
        await service.unload_adapter("alice")
    assert e.value.code == grpc.StatusCode.INTERNAL and "still serves" in str(e.value)
    got = await samples(service, request("alice"))
    assert all(r.version_spans == [(1, 0)] for r in got)




@pytest.mark.parametrize("point", ADAPTER_COMMIT_POINTS)
def test_a_server_killed_at_any_phase_of_an_adapter_commit_restarts_at_the_old_or_the_new_version(ckpt, tmp_path,
                                                                                                   point):
    state = tmp_path / "state"
    async def start():
        return (await make(ckpt, state_dir=state))[1]
    run_until_killed(push_then_crash, (start, lambda w: push(w, "alice", 1), lambda w: push(w, "alice", 2), point),
                     point)

    async def main():
        pool, weights, service = await make(ckpt, state_dir=state)
        expected = 2 if point == "adapter_record_written" else 1     # the record is the commit's last word
        a = pool.adapters.adapters["alice"]
        versions = list(range(1, expected + 1))
        assert (a.latest, sorted(a.versions)) == (expected, versions)
        assert [sorted(e.adapters.values()) for e in pool.engines] == [[f"alice@v{v}" for v in versions]] * 2
        assert sorted(p.name for p in (state / "adapters" / "alice").iterdir()) == [f"v{v}" for v in versions]
        if expected == 1:                          # the trainer pushes version 2 again
            await push(weights, "alice", 2)
        got = await samples(service, request("alice"))
        assert all(r.version_spans == [(2, 0)] for r in got)
    asyncio.run(main())


# ---- Ray engines (engine/ray_engine.py's actor side, with a FakeEngine inside) -----------------------------------
@sync
async def test_a_ray_actor_serves_an_adapter_from_a_folder_of_its_own(tmp_path, monkeypatch):
    import msgspec

    from rollout_service.engine import ray_engine
    from rollout_service.engine.types import SeqRequest, SeqResult

    monkeypatch.setattr(ray_engine, "_adapters_root", lambda: tmp_path / "actor")
    actor = object.__new__(ray_engine.EngineActor)        # without vLLM: a FakeEngine in it
    actor.engine, actor.adapter_dirs = FakeEngine("e0", vocab_size=50), {}
    await actor.engine.start()

    async def ref(data):                                  # an object-store reference, as the actor awaits it
        return data
    await actor.add_adapter("alice@v1", 7, [ref(b'{"r": 4}'), ref(b"tensors")])
    folder = tmp_path / "actor" / "7"
    assert (folder / "adapter_config.json").read_bytes() == b'{"r": 4}'
    assert (folder / "adapter_model.safetensors").read_bytes() == b"tensors"
    assert actor.engine.adapters == {7: "alice@v1"} and ("add_adapter", "alice@v1", 7) in actor.engine.events
    req = SeqRequest(seq_id="s", prompt_token_ids=[1, 2], max_tokens=3, lora_name="alice@v1", lora_id=7,
                     lora_path="/the/front/end's/path", adapter_version=1)
    out = msgspec.msgpack.decode(await actor.generate(msgspec.msgpack.encode(req)), type=SeqResult)
    assert len(out.token_ids) == 3 and actor.engine.seen[-1].lora_path == str(folder)   # this node's copy
    with pytest.raises(RuntimeError, match="not loaded on this engine"):
        await actor.generate(msgspec.msgpack.encode(msgspec.structs.replace(req, lora_id=8)))
    await actor.remove_adapter(7)
    assert not folder.exists() and actor.engine.adapters == {} and not actor.adapter_dirs
    actor.engine.fail_adapter = 1                         # vLLM refuses it: no folder left behind
    with pytest.raises(RuntimeError, match="injected"):
        await actor.add_adapter("bob@v1", 9, [ref(b"{}"), ref(b"x")])
    assert not (tmp_path / "actor" / "9").exists() and not actor.adapter_dirs



# ---- TransferWeights of an adapter (weights/transfer.py over FakeEngines with a transfer backend) --------------
async def transfer_setup(ckpt, engines=2):
    from rollout_service.weights.transfer import WeightTransfer
    from tests.unit.test_transfer_checks import LOOPBACK_CALLER, JoiningEngine

    pool = EnginePool([JoiningEngine(f"e{i}", vocab_size=50) for i in range(engines)], max_queue=64,
                      checkpoints={"policy": ckpt}, lora=LoraConfig(max_adapters=2))
    await pool.start()
    weights = WeightService.create(pool, "float32", weights_roots=[str(ckpt.parent)])
    t = WeightTransfer(weights, "gloo", 5.0, watch=False)
    async for _ in t.init("auto", "127.0.0.1", 29500, 1, 0.0, caller=LOOPBACK_CALLER):
        pass
    model = ModelInfo(path=str(ckpt), vocab_size=50, max_model_len=256, tokenizer=None)
    return pool, t, RolloutService(pool, model, Limits(8, 8), weights, t)


def adapter_metas(r=4, **kw):
    from rollout_service.weights.transfer import Meta

    return [Meta(n, "float32", tuple(x.shape)) for n, x in adapter(r=r, **kw).items()]


async def transfer(t, name, version, metas=None, config=None, **kw):
    out = []
    async for item in t.push(version, "adapter", "wait", False, adapter_metas() if metas is None else metas,
                             t.group.group_id, adapter=name, adapter_config=json.dumps(config or CONFIG), **kw):
        out.append(item)
    return out


@sync
async def test_an_adapter_transferred_over_the_group_commits_on_every_engine(ckpt):
    pool, t, service = await transfer_setup(ckpt)
    ready, out = await transfer(t, "alice", 1)
    assert ready == ("ready", sum(math.prod(m.shape) * 4 for m in adapter_metas()))
    assert (out.target, out.adapter, out.version, out.num_tensors) == ("adapter", "alice", 1, 6)
    assert [e.events[-2:] for e in pool.engines] == [[("receive_transfer", True), ("add_adapter", "alice@v1", 1)],
                                                     [("receive_transfer", False), ("add_adapter", "alice@v1", 1)]]
    from safetensors.torch import load_file

    files = load_file(str(pool.adapters.folder("alice", 1) / "adapter_model.safetensors"))
    assert sorted(files) == sorted(adapter()) and all(torch.equal(x, torch.full(x.shape, 2.0)) for x in files.values())
    got = await samples(service, request("alice"))
    assert [r.version_spans for r in got] == [[(1, 0)]] * 2
    assert not list((scratch_root() / "adapter-staging").glob("transfer-*"))   # no record left
    await transfer(t, "alice", 2)                       # the group stays up for the next push
    assert pool.adapters.adapters["alice"].latest == 2 and t.group is not None


@sync
async def test_a_bad_adapter_transfer_is_refused_naming_the_field_before_a_byte_moves(ckpt):
    from rollout_service.weights.transfer import Meta

    pool, t, _ = await transfer_setup(ckpt)
    cases = [
        ({"name": "bad/name"}, grpc.StatusCode.INVALID_ARGUMENT, "adapter"),
        ({"config": CONFIG | {"r": 64}}, grpc.StatusCode.INVALID_ARGUMENT, "max_rank"),
        ({"metas": adapter_metas(r=3)}, grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        ({"metas": adapter_metas()[:-1]}, grpc.StatusCode.INVALID_ARGUMENT, "missing"),
        ({"metas": adapter_metas() + [Meta("x.lora_A.weight", "float32", (4, 6))]}, grpc.StatusCode.INVALID_ARGUMENT,
         "x.lora_A.weight"),
        ({"partial": True}, grpc.StatusCode.INVALID_ARGUMENT, "partial"),
    ]
    for case, code, words in cases:
        case = dict(case)
        partial = case.pop("partial", False)
        with pytest.raises(ServiceError) as e:
            out = []
            async for item in t.push(1, "adapter", "wait", partial, case.get("metas", adapter_metas()),
                                     t.group.group_id, adapter=case.get("name", "alice"),
                                     adapter_config=json.dumps(case.get("config", CONFIG))):
                out.append(item)
        assert e.value.code == code and words in str(e.value), (case, str(e.value))
    assert not any(ev[0] == "receive_transfer" for e in pool.engines for ev in e.events)   # nothing moved
    assert t.group is not None and not pool.adapters.adapters
    await transfer(t, "alice", 1)
    with pytest.raises(ServiceError) as e:                         # versions strictly increase, as pushes
        await transfer(t, "alice", 1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and t.group is not None
    with pytest.raises(ServiceError) as e:                         # an adapter field on a policy transfer
        async for _ in t.push(1, "policy", "wait", True, adapter_metas(), t.group.group_id, adapter="alice"):
            pass
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "TARGET_ADAPTER" in str(e.value)


@sync
async def test_an_adapter_transfer_that_fails_commits_nothing(ckpt):
    pool, t, service = await transfer_setup(ckpt)
    await transfer(t, "alice", 1)
    pool.engines[1].receive_error = RuntimeError("Connection closed by peer [127.0.0.1]:4321")
    with pytest.raises(ServiceError) as e:                         # a receive broke off: the group is closed
        await transfer(t, "alice", 2)
    assert e.value.code == grpc.StatusCode.ABORTED and "adapter 'alice' version 1 serves" in str(e.value)
    assert t.group is None and pool.adapters.adapters["alice"].latest == 1
    pool.engines[1].receive_error = None
    async for _ in t.init("auto", "127.0.0.1", 29500, 1, 0.0, caller="ipv4:127.0.0.1:40000"):
        pass
    pool.engines[1].fail_adapter = 1                               # an engine cannot load it: all or none
    with pytest.raises(ServiceError) as e:
        await transfer(t, "alice", 2)
    assert e.value.code == grpc.StatusCode.INTERNAL and "version 1 still serves" in str(e.value)
    assert t.group is not None                                     # every engine had received: still in step
    assert [sorted(e.adapters.values()) for e in pool.engines] == [["alice@v1"]] * 2
    assert not pool.adapters.folder("alice", 2).exists()
    assert not list((scratch_root() / "adapter-staging").glob("transfer-*"))
    await transfer(t, "alice", 2)
    got = await samples(service, request("alice"))
    assert [r.version_spans for r in got] == [[(2, 0)]] * 2
