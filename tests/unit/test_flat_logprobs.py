"""The engine asks vLLM for flat log-probs (SamplingParams.flat_logprobs): its conversion must read them exactly as it
reads vLLM's per-position dicts, streamed deltas (slices) included."""
import pytest

from rollout_service.engine.vllm_engine import _logprobs

logprobs_mod = pytest.importorskip("vllm.logprobs")


class _Comp:
    def __init__(self, logprobs):
        self.logprobs = logprobs


def _positions():
    """(sampled token, its log-prob, its rank, top-k ids, top-k log-probs) per position: the sampled token inside
    the top k at rank 1 and at rank 3, and outside it (rank 9)."""
    return [(5, -0.1, 1, [5, 7, 9], [-0.1, -2.5, -3.0]),
            (9, -3.0, 3, [4, 2, 9], [-0.5, -1.5, -3.0]),
            (1, -6.25, 9, [3, 8, 6], [-0.2, -1.0, -4.0])]


def _containers(k: int):
    flat, dicts = logprobs_mod.FlatLogprobs(), []
    for tok, lp, rank, ids, lps in _positions():
        for container in (flat, dicts):     # vLLM's own append: the sampled token first, then ranks 1..k
            logprobs_mod.append_logprobs_for_next_position(container, [tok, *ids[:k]], [lp, *lps[:k]],
                                                           [None] * (k + 1), rank, k)
    return flat, dicts


@pytest.mark.parametrize("k", [0, 1, 3])
def test_flat_log_probs_read_as_the_dicts_are(k):
    flat, dicts = _containers(k)
    tokens = [p[0] for p in _positions()]
    got, want = _logprobs(_Comp(flat), tokens, k), _logprobs(_Comp(dicts), tokens, k)
    assert got == want
    assert got[0] == [-0.1, -3.0, -6.25]
    if k == 3:
        assert got[1] == [[5, 7, 9], [4, 2, 9], [3, 8, 6]]
        assert got[2][2] == [-0.2, -1.0, -4.0]


def test_a_delta_slice_reads_its_own_positions():
    flat, dicts = _containers(3)
    tokens = [p[0] for p in _positions()]
    got = _logprobs(_Comp(flat[-2:]), tokens[1:], 3)      # what vLLM hands a DELTA output: the new positions
    assert got == _logprobs(_Comp(dicts[-2:]), tokens[1:], 3)
    assert got[0] == [-3.0, -6.25] and got[1][0] == [4, 2, 9]
