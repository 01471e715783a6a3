"""Weight pushes into a model with tied embeddings (SmolLM2, the default model, is tied): the served
log-probs must follow the pushed embedding/head, not a stale copy. Then that service is SIGKILLed: it leaves no
engine process behind (the service is this module's own, so its end costs no extra engine start)."""
import signal
import time

import numpy as np
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_client import RolloutClient
from tests.tiny_models import build_tiny_model
from rollout_service.drafting.reference import processed_logprobs
from tests.integration.services import running_service

PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77]]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-tied", tied=True, seed=3)
    with running_service(path, tmp_path_factory.mktemp("logs") / "tied.log", clean_exit=False) as svc, \
            RolloutClient(svc.target) as c:                   # SIGKILLed by the last test
        yield path, c, svc


def check(c, model, version):
    for group in c.generate_all(PROMPTS, n=2, max_tokens=8, ignore_eos=True, temperature=1.0, seed=1):
        for s in group:
            assert s.policy_version == version
            ref = processed_logprobs(model, PROMPTS[s.prompt_index], s.token_ids.tolist(), 1.0, 0, 1.0)
            np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-3, rtol=0)


def test_push_into_tied_model_updates_embedding_and_head(tied):
    path, c, _ = tied
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    check(c, model, 0)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.7).add_(0.3 * torch.randn_like(model.model.embed_tokens.weight))
    res = c.push_weights(model, 1)                  # the tied lm_head is sent once, under embed_tokens
    assert res.num_tensors == len(model.state_dict()) - 1
    check(c, model, 1)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.0)
    c.push_weights({"model.embed_tokens.weight": model.model.embed_tokens.weight}, 2, partial=True)
    check(c, model, 2)


def test_transfer_into_tied_model_updates_embedding_and_head(tied):
    """The same over the weight-transfer group (the trainer example's default path): vLLM's layerwise reload
    skips the tied lm_head, which must still follow the new embedding."""
    from rollout_client.transfer import WeightSync

    path, c, _ = tied
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    v = c.status().policy_version
    sync = WeightSync(c, timeout_s=20)
    sync.connect(timeout=60)
    try:
        for step in (1, 2):
            with torch.no_grad():
                model.model.embed_tokens.weight.mul_(-1.3).add_(0.2 * torch.randn_like(model.model.embed_tokens.weight))
            sync.push(model, v + step)
            check(c, model, v + step)
    finally:
        sync.close()


def remaining(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_engine_processes_die_with_a_sigkilled_server(tied):
    """Every process of its tree, recorded once it was ready (vLLM's EngineCore, its worker, multiprocessing's
    resource tracker), is gone within 10 s of the server's SIGKILL."""
    svc = tied[2]
    tree = psutil.Process(svc.proc.pid).children(recursive=True)
    try:
        names = [p.name() for p in tree]
        assert any("EngineCore" in n for n in names), names
        svc.proc.send_signal(signal.SIGKILL)
        svc.proc.wait(10)
        t0 = time.monotonic()
        while remaining(tree) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        left = remaining(tree)
        assert not left, f"still running 10 s after the server's SIGKILL: {left}"
        print(f"{len(tree)} processes under the server ({', '.join(names)}): all gone "
              f"{time.monotonic() - t0:.1f} s after it was reaped")
    finally:
        for p in tree:                               # never leave anything behind, pass or fail
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
