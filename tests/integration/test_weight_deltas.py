"""Delta pushes on a real engine (rollout_client.delta.WeightDeltas against the shared float32 service): a full anchor,
then deltas of ~1% of the elements; each version serves the trainer's weights (log-probs against a forward pass), its
fingerprint is the trainer's, seeded samples equal a full push of the same state, and a delta against a version that
no longer serves falls back to a full push by itself."""
import torch
from rollout_client.delta import WeightDeltas, fingerprint

from tests.integration.test_weights import PROMPTS, assert_serves, next_version


def optimizer_step(model, seed: int, fraction: float = 0.01) -> None:
    """Move `fraction` of every tensor's elements, as a bf16 optimizer step does."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            pick = torch.rand(p.shape, generator=g) < fraction
            p.add_(pick * 0.05 * p.std())


def test_deltas_serve_the_trainers_weights_and_fall_back_to_a_full_push(client, policy):
    deltas = WeightDeltas(client, anchor_every=3)
    v = next_version(client)
    first = deltas.push(policy, v)
    assert deltas.last_kind == "full" and first.base_version == 0 and first.fingerprint == fingerprint(policy)
    kinds = []
    for seed in (1, 2, 3):
        optimizer_step(policy, seed)
        v += 1
        res = deltas.push(policy, v)
        kinds.append(deltas.last_kind)
        assert res.version == v and res.fingerprint == fingerprint(policy) == deltas.fingerprint()
        if deltas.last_kind == "delta":
            assert res.base_version == v - 1 and res.num_bytes == deltas.last_bytes
            full_bytes = sum(p.numel() * 4 for p in policy.state_dict().values())
            assert deltas.last_bytes < full_bytes / 10, (deltas.last_bytes, full_bytes)
        assert_serves(client, policy, v)
    assert kinds == ["delta", "delta", "full"]                 # anchor_every=3: a full push every third
    optimizer_step(policy, 4)
    v += 1
    deltas.push(policy, v)
    by_delta = client.generate_all(PROMPTS, n=2, max_tokens=10, ignore_eos=True, temperature=1.0, seed=11)
    full = client.push_weights(policy, v + 1)
    assert full.fingerprint == client.status().policy_fingerprint == fingerprint(policy)
    by_full = client.generate_all(PROMPTS, n=2, max_tokens=10, ignore_eos=True, temperature=1.0, seed=11)
    for a, b in zip(sum(by_delta, []), sum(by_full, [])):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.logprobs.tolist() == b.logprobs.tolist()
    optimizer_step(policy, 5)                                  # the deltas' base (v) no longer serves (v + 1 does)
    res = deltas.push(policy, v + 2)
    assert deltas.last_kind == "full after refusal" and res.version == v + 2 and res.base_version == 0
    assert_serves(client, policy, v + 2)
