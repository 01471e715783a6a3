"""A served precision (engine.quantization = int8) on a real engine: samples carry the quantized policy's log-probs
(against an independent int8 forward pass, drafting/reference.py int8_w8a8, and re-scored by an independent plain
int8 vLLM engine loaded from the pushed weights, tests/integration/int8_rescore.py), and every push path (PushWeights
in float32 and bfloat16, LoadWeights, TransferWeights) is quantized at commit with scales from the pushed weights.
One service for the module (one engine start), and one fresh int8 engine for the re-scoring."""
import copy
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from rollout_client import RolloutClient
from rollout_client.transfer import WeightSync

from rollout_service.drafting.lossless import INT8_SPREAD_FACTOR, LOGPROB_ATOL
from rollout_service.drafting.reference import int16_pair_saturation, int8_w8a8, processed_logprobs
from tests.integration.int8_rescore import rescore
from tests.integration.services import running_service
from tests.integration.test_weights import PROMPTS, perturb

# Served int8 log-probs against the independent int8 forward pass, measured on this tiny model on this CPU
# (2026-11-27): per token typically 1e-5 nats (median), 90% below 1e-4; a few tokens up to 1.7e-3 after larger
# pushes, as expected where vLLM's float kernels and transformers' round an activation that lies within float32
# rounding of an int8 rounding boundary different ways (not traced token by token here; shown on SmolLM2:
# drafting/reference.py int8_rounding_spread, docs/contract.md). The float32 policy is 3.7e-3 nats away on average
# before any push. The bounds leave 2-3x room.
MEDIAN_TOLERANCE, P90_TOLERANCE, MAX_TOLERANCE = 5e-5, 3e-4, 5e-3


@pytest.fixture(scope="module")
def qservice(tiny_model, tmp_path_factory):
    with running_service(tiny_model, tmp_path_factory.mktemp("logs") / "quantized.log", "--quantization", "int8",
                         "--weights-root", str(tmp_path_factory.getbasetemp())) as svc:
        yield svc


@pytest.fixture(scope="module")
def qclient(qservice):
    with RolloutClient(qservice.target) as c:
        yield c


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def assert_serves_int8(client, model, version: int) -> list:
    """Seeded samples' log-probs are the int8 model's (within the measured bounds above) and not the float model's.
    Returns the samples, grouped by prompt."""
    quantized = int8_w8a8(copy.deepcopy(model))
    groups = client.generate_all(PROMPTS, n=2, max_tokens=12, ignore_eos=True, temperature=1.0, seed=7)
    to_int8, to_float = [], []
    for p, group in enumerate(groups):
        for s in group:
            assert s.policy_version == version
            tokens = s.token_ids.tolist()
            to_int8.append(np.abs(s.logprobs - processed_logprobs(quantized, PROMPTS[p], tokens, 1.0, 0, 1.0).numpy()))
            to_float.append(np.abs(s.logprobs - processed_logprobs(model, PROMPTS[p], tokens, 1.0, 0, 1.0).numpy()))
    to_int8, to_float = np.concatenate(to_int8), np.concatenate(to_float)
    stats = (f"served vs int8 reference: median {np.median(to_int8):.1e}, p90 {np.quantile(to_int8, 0.9):.1e}, "
             f"max {to_int8.max():.1e} nats; vs float32: mean {to_float.mean():.1e}")
    assert np.median(to_int8) < MEDIAN_TOLERANCE and np.quantile(to_int8, 0.9) < P90_TOLERANCE, stats
    assert to_int8.max() < MAX_TOLERANCE, stats
    assert to_float.mean() > 10 * to_int8.mean() and to_float.mean() > 1e-3, stats + " (not quantized?)"
    return groups


def flat(groups) -> list:
    """(prompt ids, sample) of every sample, grouped by prompt in PROMPTS' order."""
    return [(PROMPTS[p], s) for p, group in enumerate(groups) for s in group]


def assert_rescored_by_a_fresh_int8_engine(tiny_model, weights_dir, served, before) -> None:
    """The served samples (prompt, sample) re-scored by an independent plain int8 vLLM engine loaded from the pushed
    weights (`weights_dir`'s model.safetensors with the tiny model's config and tokenizer): their log-probs agree
    within the same bounds as against the int8 forward pass. Its power: samples served before the push (`before`,
    another policy) are far from it."""
    pushed = weights_dir / "pushed"
    pushed.mkdir()
    for f in tiny_model.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, pushed / f.name)
    (pushed / "model.safetensors").symlink_to(weights_dir / "model.safetensors")
    rescored = rescore(pushed, [(p, s.token_ids.tolist()) for p, s in served + before], weights_dir / "rescore")
    agree = np.concatenate([np.abs(s.logprobs - r) for (_, s), r in zip(served, rescored)])
    other = np.concatenate([np.abs(s.logprobs - r) for (_, s), r in zip(before, rescored[len(served):])])
    stats = (f"served vs a fresh int8 engine's prefill scoring: median {np.median(agree):.1e}, p90 "
             f"{np.quantile(agree, 0.9):.1e}, max {agree.max():.1e} nats over {agree.size} tokens; samples of the "
             f"version before: mean {other.mean():.1e}")
    print(stats)
    assert np.median(agree) < MEDIAN_TOLERANCE and np.quantile(agree, 0.9) < P90_TOLERANCE, stats
    assert agree.max() < MAX_TOLERANCE, stats
    assert other.mean() > MAX_TOLERANCE and other.mean() > 100 * agree.mean(), stats + " (no power?)"


def test_status_and_metrics_say_int8(qservice, qclient):
    q = qclient.status().quantization
    assert (q.method, q.scheme, q.dtype, q.batch_invariant) == ("int8", "compressed-tensors w8a8", "float32", False)
    assert "per output channel" in q.weights and "per token" in q.activations
    code, body = qservice.http_get("/metrics")
    assert code == 200
    assert 'rollout_served_precision{batch_invariant="false",drafter_method="",dtype="float32",method="int8"} 1.0' \
        in body
    patches = {p.name: p.state for p in qclient.status().patches}
    assert patches["cpu_int8_reload_scales"] == "applied"


def test_samples_carry_the_quantized_policys_logprobs(qclient, trainer):
    assert_serves_int8(qclient, trainer, 0)


def test_float32_and_bfloat16_pushes_are_quantized_at_commit(qclient, trainer):
    perturb(trainer, seed=21, scale=0.3)
    v = qclient.status().policy_version + 1
    assert qclient.push_weights(trainer, v).version == v
    assert_serves_int8(qclient, trainer, v)
    perturb(trainer, seed=22, scale=0.3)
    with torch.no_grad():                         # a bf16 trainer: the engine quantizes what it receives
        for p in trainer.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert qclient.push_weights(trainer, v + 1, dtype=torch.bfloat16).version == v + 1
    assert_serves_int8(qclient, trainer, v + 1)


def test_load_weights_and_transfer_weights_are_quantized_at_commit(qclient, trainer, tiny_model, tmp_path):
    from safetensors.torch import save_file

    before = flat(qclient.generate_all(PROMPTS, n=2, max_tokens=12, ignore_eos=True, temperature=1.0, seed=8))
    perturb(trainer, seed=23, scale=0.3)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in trainer.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    with torch.no_grad():
        for p in trainer.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    v = qclient.status().policy_version + 1
    assert qclient.load_weights(str(tmp_path), v).version == v
    served = flat(assert_serves_int8(qclient, trainer, v))
    assert_rescored_by_a_fresh_int8_engine(tiny_model, tmp_path, served, before)
    perturb(trainer, seed=24, scale=0.3)
    sync = WeightSync(qclient, timeout_s=20)
    sync.connect(timeout=60)
    try:
        assert sync.push(trainer, v + 1).version == v + 1
    finally:
        sync.close()
    assert_serves_int8(qclient, trainer, v + 1)


def chain_prompts(model_dir, bases, length: int = 4) -> list[list[int]]:
    """Prompts an n-gram drafter's drafts are often accepted on: BOS, then the model's greedy continuation of the
    prompt itself, then the base prompt (iterated until the continuation is the one inserted). Once a sample starts
    with that continuation's first token, the drafter matches it in the prompt and proposes the rest: the model's
    likely next tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def greedy(ids):
        out = []
        for _ in range(length):
            with torch.no_grad():
                out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
        return out

    prompts = []
    for base in bases:
        chain = greedy(base)
        for _ in range(8):
            prompt = base[:1] + chain + base[1:]
            chain, before = greedy(prompt), chain
            if chain == before:
                break
        prompts.append(base[:1] + chain + base[1:])
    return prompts


def test_ngram_speculation_over_an_int8_target_is_lossless_by_the_verify_lossless_command(tiny_model):
    """Issue 46 item 5, as a user runs it: `verify-lossless --method ngram --quantization int8` serves int8 on both
    engines (plain and speculative) and passes: the G-tests find the speculative samples distributed as the plain
    int8 ones, and the log-probs of the checked samples (6, from int8 verify passes) equal the independent int8
    forward pass (drafting/reference.py int8_w8a8) within max(5e-3, 1.5 x its rounding spread), which the float32
    policy is not within where int8 sums saturate (elsewhere the report says when it is), with drafts proposed,
    accepted and rejected (chain_prompts). Power: the same speculative
    engine sampling at temperature 0.6 in the same batches is rejected."""
    prompts = chain_prompts(tiny_model, PROMPTS)
    cmd = [sys.executable, "-m", "rollout_service.cli", "verify-lossless", "--model", str(tiny_model),
           "--method", "ngram", "--quantization", "int8", "-k", "3", "--prompt-lookup-min", "1",
           "--prompt-lookup-max", "3", "--samples", "600", "--max-tokens", "3", "--top-k", "0",
           "--power-temperature", "0.6", "--prompt-ids", *[",".join(map(str, p)) for p in prompts]]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0 and "RESULT: LOSSLESS" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "served precision int8: both engines serve it" in r.stdout and "speculation=ngram" in r.stdout
    assert "proposed nothing" not in r.stdout
    assert 0.02 < float(re.search(r"acceptance rate ([0-9.]+)", r.stdout)[1]) < 0.95, r.stdout   # 0.078 measured
    to_float = float(re.search(r"the float32 policy is ([0-9.e+-]+) from the samples", r.stdout)[1])
    spread = float(re.search(r"own spread under float32 rounding on these samples is ([0-9.e+-]+)", r.stdout)[1])
    tolerance = max(LOGPROB_ATOL["int8"], INT8_SPREAD_FACTOR * spread)
    if int16_pair_saturation():   # int8 sums saturate in int16 pairs (x86 without VNNI): far from float32
        assert "cannot tell int8 from float32" not in r.stdout, r.stdout
    else:                         # exact int8 sums (VNNI, AMX, Arm): on the tiny model float32 can fall within the
        #                           tolerance (3.6e-3 against 5e-3 on an AVX-512 VNNI CPU); the report must say so
        assert ("cannot tell int8 from float32" in r.stdout) == (to_float <= tolerance), r.stdout
    assert re.search(r"power: .* -> NOT LOSSLESS \(it must be rejected\)", r.stdout), r.stdout
