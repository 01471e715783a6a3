"""LoRA adapters as policies, bookkeeping only (FakeEngines): the PEFT config and tensor checks, commits on every
engine or none, each name's version line, the versions kept loaded (samples in flight finish on theirs), the limits,
admission by policy name and version, restarts loading every adapter. Tokens and log-probs against a merged forward
pass are tests/integration/test_lora.py's."""
import asyncio
import functools
import json

import grpc
import pytest
import torch
from rollout_client.weights import push_stream
from safetensors.torch import save_file

from rollout_service.api import pb
from rollout_service.config import LoraConfig
from rollout_service.errors import ServiceError
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.server.service import RolloutService
from rollout_service.validation import Limits
from rollout_service.weights.adapters import PREFIX, parse_config
from rollout_service.weights.manifest import read_manifest
from rollout_service.weights.service import Chunk, Header, Trailer, WeightService
from tests.fake_engine import FakeEngine

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


async def make(ckpt, engines=2, **lora):
    pool = EnginePool([FakeEngine(f"e{i}", vocab_size=50, step_s=0.002) for i in range(engines)], max_queue=64,
                      checkpoints={"policy": ckpt}, lora=LoraConfig(**({"max_adapters": 2} | lora)))
    await pool.start()
    weights = WeightService.create(pool, "float32", weights_roots=[str(ckpt.parent)])
    model = ModelInfo(path=str(ckpt), vocab_size=50, max_model_len=256, tokenizer=None)
    return pool, weights, RolloutService(pool, model, Limits(8, 8), weights, None)


async def push(weights, name, version, tensors=None, config=None, **kw):
    msgs = list(push_stream(tensors if tensors is not None else adapter(seed=version), version,
                            target=pb.TARGET_ADAPTER, chunk_bytes=64, adapter=name,
                            adapter_config=json.dumps(config or CONFIG)))
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
