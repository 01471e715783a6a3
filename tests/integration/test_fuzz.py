"""Fuzzing every RPC of the shared real service: a seeded sample of bench/fuzz.py (random bytes, bit-flipped
valid messages, random field values, hostile LoadWeights paths inside and outside --weights-root, hostile and
abandoned InitWeightTransfer set-ups, TransferWeights without a group). Every
call ends with a proper status and a message (never UNKNOWN or INTERNAL), the service stays ready, and a
seeded Generate returns the same samples after the fuzzing as before it."""
from bench.fuzz import make_hostile_root, render, run_fuzz

CALLS = 500          # 50 per RPC; bench/fuzz.py runs 10,000 on demand


def test_fuzzed_calls_end_with_a_proper_status(client, service, tiny_model, tmp_path_factory):
    # no commits: other tests changed the shared service's weights, and loading the checkpoint would change what
    # it serves (with one in the root, a fuzzed LoadWeights of root/../<root>/model committed it: 2026-11-28)
    paths, _ = make_hostile_root(tmp_path_factory.mktemp("fuzz-root"), tiny_model, committable=False)
    before = client.status()
    result = run_fuzz(client, service.http_get, paths, calls=CALLS, seed=0, timeout=60,
                      busy_ports=[service.http_port])
    print("\n" + render(result))
    assert not result["failures"], "\n".join(result["failures"][:20])
    after = client.status()
    assert after.ready and (after.policy_version, after.draft_version) == (before.policy_version, before.draft_version)
    assert not after.weight_transfer.joined
