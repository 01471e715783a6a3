"""AReaL's own rollout client, installed from PyPI (`areal==1.0.4`, scripts/install.sh), against the shared real
service's SGLang dialect: `areal.engine.sglang_remote.RemoteSGLangEngine` generates with its `agenerate`, and
updates weights by path in its disk mode, driven exactly as AReaL's FSDP trainer drives it
(`FSDPEngine._update_weights_from_disk`): `pause_generation`, `update_weights_from_disk(meta)`, the trainer
saves a Hugging Face checkpoint at `meta.path` and publishes the save through AReaL's `name_resolve`, waits
for the engine's future, `continue_generation`. Log-probs checked against an independent float32 forward pass.

AReaL is imported inside a fixture (it takes ~10 s and brings its own logging): a venv without it fails
these tests (ImportError), it does not skip them.
"""
import asyncio
import threading
from datetime import datetime

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_service.drafting.reference import processed_logprobs
from tests.integration.services import wait_for

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]
EXPERIMENT, TRIAL = "rollout-service", "areal-client"


@pytest.fixture(scope="module")
def areal(tmp_path_factory):
    """AReaL's modules, with its name_resolve (how its trainer tells the rollout engine a checkpoint is
    saved) on a file store in this session's temporary folder."""
    from areal.api import cli_args, io_struct
    from areal.engine import sglang_remote
    from areal.utils import name_resolve, names

    name_resolve.reconfigure(cli_args.NameResolveConfig(
        type="nfs", nfs_record_root=str(tmp_path_factory.mktemp("areal_name_resolve"))))
    return type("Areal", (), {"cli": cli_args, "io": io_struct, "RemoteSGLangEngine": sglang_remote.RemoteSGLangEngine,
                              "name_resolve": name_resolve, "names": names})


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The trainer's model: the weights the service starts with (restored at the end of the module)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    SERVING["model"] = model
    return model


@pytest.fixture(scope="module")
def engine(areal, service, policy, tmp_path_factory):
    """AReaL's RemoteSGLangEngine pointed at the service's HTTP port (AReaL's `addr`: host:port)."""
    config = areal.cli.InferenceEngineConfig(
        experiment_name=EXPERIMENT, trial_name=TRIAL, backend="sglang:d1", setup_timeout=60,
        request_timeout=120, request_retries=1, max_concurrent_rollouts=8, consumer_batch_size=1)
    eng = areal.RemoteSGLangEngine(config)
    eng.initialize(addr=service.http.removeprefix("http://"))
    yield eng
    # The shared service serves the starting weights again for the tests after these (AReaL's disk mode too)
    disk_update(areal, eng, policy, tmp_path_factory.mktemp("areal_restore"))
    eng.destroy()


SERVING = {}                 # the model whose weights the service serves now (the trainer's view)


def disk_update(areal, eng, model, file_root) -> None:
    """What AReaL's FSDP trainer does for a disk weight update (fsdp_engine._update_weights_from_disk),
    then the version bump its training loop makes (`rollout.set_version(step + 1)`)."""
    meta = areal.io.WeightUpdateMeta.from_disk(EXPERIMENT, TRIAL, str(file_root))
    key = areal.names.update_weights_from_disk(EXPERIMENT, TRIAL, eng.get_version())
    eng.pause_generation()
    fut = eng.update_weights_from_disk(meta)
    model.save_pretrained(meta.path)
    areal.name_resolve.add(key, str(datetime.now().timestamp()), keepalive_ttl=120)
    try:
        fut.result(timeout=120)
    finally:
        # AReaL's trainer never retries a version; a test that does must not find this save published
        areal.name_resolve.delete(key)
    eng.continue_generation()
    eng.set_version(eng.get_version() + 1)
    SERVING["model"] = model


def served_version(service) -> int:
    return int(httpx.get(service.http + "/get_weight_version", timeout=30).json()["weight_version"])


def perturbed(model, seed: int, scale: float = 0.05):
    """A trainer step's worth of change: every parameter moved by noise (a new model; `model` is kept)."""
    new = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    new.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return new


def generate(areal, eng, prompts, **gconfig):
    """AReaL's agenerate, one request per prompt, concurrently (as its workflows call it)."""
    g = areal.cli.GenerationHyperparameters(**gconfig)

    async def run():
        return await asyncio.gather(*(eng.agenerate(areal.io.ModelRequest(input_ids=list(p), gconfig=g))
                                      for p in prompts))
    return asyncio.run(run())


def logprob_gap(model, prompt, response, temperature, top_k=0) -> float:
    """Largest |served log-prob - the forward pass's| over the response's tokens."""
    ref = processed_logprobs(model, prompt, list(response.output_tokens), temperature, top_k, 1.0)
    assert torch.isfinite(ref).all(), "the service sampled a token the reference rules out"
    return float(np.max(np.abs(np.asarray(response.output_logprobs) - ref.numpy())))


def test_areal_agenerate(areal, engine, policy):
    """AReaL's generation request (input_ids, return_logprob, its sampling params) parsed by AReaL's own
    SGLang backend: tokens, per-token log-probs of the policy, stop reason."""
    out = generate(areal, engine, PROMPTS, max_new_tokens=12, temperature=0.8, top_k=50, ignore_eos=True)
    for prompt, r in zip(PROMPTS, out):
        assert r.stop_reason == "length" and len(r.output_tokens) == 12 == len(r.output_logprobs)
        assert r.input_tokens == prompt
        assert logprob_gap(policy, prompt, r, 0.8, top_k=50) < 2e-3
    # AReaL's defaults (top_k 1e8, i.e. off; temperature 1) as its configs leave them; eos may stop it early
    r, = generate(areal, engine, PROMPTS[:1], max_new_tokens=8)
    assert r.stop_reason in ("stop", "length") and 1 <= len(r.output_tokens) <= 8
    assert logprob_gap(policy, PROMPTS[0], r, 1.0) < 2e-3


def tokens_flowing(service) -> None:
    """Return once the engine is decoding: a gRPC request streaming its tokens (on the one engine, so in the same
    batch as every sequence admitted before it) has its first tokens. It is aborted by the update that follows."""
    from rollout_client import RolloutClient

    seen = threading.Event()

    def clock():
        with RolloutClient(service.target) as c:
            try:
                for s in c.generate([[1, 2, 3]], max_tokens=400, ignore_eos=True, stream_tokens=True):
                    if s.delta and s.delta_start + len(s.token_ids) >= 3:
                        seen.set()
            except Exception:  # noqa: BLE001 - the abort ends it; only its first tokens matter
                pass
            seen.set()

    threading.Thread(target=clock, daemon=True).start()
    assert seen.wait(60), "no tokens generated in 60 s"


def test_areal_disk_update_interrupts_and_its_partial_rollout_continues(areal, service, engine, policy, tmp_path):
    """A generation in flight when AReaL's trainer updates weights from disk: pause_generation (abort mode)
    ends it and the service answers the tokens it has (SGLang's finish_reason abort with the output ids and
    log-probs); AReaL's agenerate continues from them (its partial-rollout loop: prompt + output so far, the
    tokens left), the request waits out the update and finishes under the new weights. One rollout of 480
    tokens, the first part the old policy's and the rest the new one's, with AReaL's versions saying which; the
    service commits exactly one new version, and serves the new weights afterwards."""
    new = perturbed(policy, seed=11)
    before = served_version(service)
    areal_version = engine.get_version()
    result = {}

    def long_rollout():
        result["r"], = generate(areal, engine, PROMPTS[:1], max_new_tokens=480, temperature=1.0, ignore_eos=True)

    t = threading.Thread(target=long_rollout)
    t.start()
    wait_for(lambda: httpx.get(service.http + "/v1/status", timeout=30).json()["queue_depth"] > 0, 30,
             "AReaL's request to be admitted")
    tokens_flowing(service)
    disk_update(areal, engine, new, tmp_path)
    t.join(180)
    assert not t.is_alive(), "AReaL's interrupted rollout never finished"
    assert served_version(service) == before + 1

    r = result["r"]
    assert r.stop_reason == "length" and len(r.output_tokens) == 480 and r.input_tokens == PROMPTS[0]
    cut = r.output_versions.count(areal_version)         # tokens of the aborted attempt, continued by AReaL
    assert 0 < cut < 480 and r.output_versions == [areal_version] * cut + [areal_version + 1] * (480 - cut)
    old_part = type(r)(input_tokens=r.input_tokens, output_tokens=r.output_tokens[:cut],
                       output_logprobs=r.output_logprobs[:cut])
    assert logprob_gap(policy, PROMPTS[0], old_part, 1.0) < 2e-3
    # the rest: the new weights on the whole prefix (and far enough from the old that the check tells them apart)
    ref_new = processed_logprobs(new, PROMPTS[0], list(r.output_tokens), 1.0, 0, 1.0)[cut:]
    ref_old = processed_logprobs(policy, PROMPTS[0], list(r.output_tokens), 1.0, 0, 1.0)[cut:]
    served = np.asarray(r.output_logprobs[cut:])
    assert np.max(np.abs(served - ref_new.numpy())) < 2e-3
    assert np.max(np.abs(served - ref_old.numpy())) > 0.05

    fresh = generate(areal, engine, PROMPTS, max_new_tokens=10, temperature=1.0, ignore_eos=True)
    for prompt, r in zip(PROMPTS, fresh):
        assert logprob_gap(new, prompt, r, 1.0) < 2e-3


def test_areal_disk_update_refused_changes_nothing(areal, service, engine, policy, tmp_path):
    """A checkpoint the service cannot load (a tensor of the wrong shape): AReaL's update future raises, the
    served version and weights stay."""
    before = served_version(service)
    broken = perturbed(policy, seed=12)
    broken.model.norm.weight = torch.nn.Parameter(torch.ones(3))
    serving = SERVING["model"]
    with pytest.raises(Exception) as e:
        disk_update(areal, engine, broken, tmp_path)
    engine.continue_generation()                   # the trainer's pause is still held after the failure
    assert SERVING["model"] is serving
    assert "/update_weights_from_disk" in str(e.value) and "status=400" in str(e.value), str(e.value)
    assert served_version(service) == before
    r, = generate(areal, engine, PROMPTS[:1], max_new_tokens=6, temperature=1.0, ignore_eos=True)
    assert logprob_gap(SERVING["model"], PROMPTS[0], r, 1.0) < 2e-3
