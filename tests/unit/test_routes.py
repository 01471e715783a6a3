"""Routed-experts rows as the service carries them (engine/types.py Routes): which policy version routed each row,
a partial sample's rows joined to its continuation's, a slow reader's deltas merged (no vLLM)."""
import numpy as np
import pytest

from rollout_service.engine.types import Routes, SeqResult, TokenDelta, route_spans
from rollout_service.pool.partial import Partial
from rollout_service.pool.requests import Progress

LAYERS, K = 2, 2


def rows(first: int, n: int, spans=None, value=None) -> Routes:
    data = np.arange(first, first + n, dtype=np.uint8).repeat(LAYERS * K) if value is None else \
        np.full(n * LAYERS * K, value, dtype=np.uint8)
    return Routes(first_row=first, rows=n, layers=LAYERS, top_k=K, dtype="uint8", data=data.tobytes(),
                  version_spans=spans or [(0, first)])


def test_each_row_is_labelled_with_the_version_of_the_step_it_was_an_input_of():
    # prompt of 5 tokens; tokens 0-2 by version 1, 3- by version 2: rows 0-4 (prompt) -> the step of token 0;
    # row 5 (token 0 as input) -> token 1's step ... row 7 (token 2) -> token 3's step: version 2
    assert route_spans([(1, 0), (2, 3)], prompt_len=5, first_row=0) == [(1, 0), (2, 7)]
    assert route_spans([(1, 0)], prompt_len=5, first_row=0) == [(1, 0)]
    # a continuation's rows from 7 on: the prompt (5) + the partial's tokens (3) - 1
    assert route_spans([(2, 0)], prompt_len=8, first_row=7) == [(2, 7)]
    # a version that produced only token 0 labels no row beyond the prompt's
    assert route_spans([(1, 0), (2, 1)], prompt_len=5, first_row=0) == [(1, 0), (2, 5)]


def test_rows_join_in_order_and_refuse_a_gap():
    a, b = rows(0, 3, [(1, 0)]), rows(3, 2, [(2, 3)])
    ab = a.then(b)
    assert (ab.first_row, ab.rows, ab.version_spans) == (0, 5, [(1, 0), (2, 3)])
    assert np.frombuffer(ab.data, np.uint8).reshape(5, LAYERS, K)[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        a.then(rows(4, 1))
    tail = ab.since(2)
    assert (tail.first_row, tail.rows, tail.version_spans) == (2, 3, [(1, 2), (2, 3)])
    assert np.frombuffer(tail.data, np.uint8).reshape(3, LAYERS, K)[:, 0, 0].tolist() == [2, 3, 4]


def test_a_continued_partial_keeps_its_rows_then_the_continuations():
    partial = Partial(token_ids=[10, 11, 12], logprobs=[-1.0] * 3, version_spans=[(1, 0)],
                      routed_experts=rows(0, 7, [(1, 0)], value=1))           # prompt 5 + 3 tokens - 1
    more = SeqResult(token_ids=[13, 14], logprobs=[-1.0, -1.0], finish_reason="length", version_spans=[(2, 0)],
                     routed_experts=rows(7, 2, [(2, 7)], value=2))
    whole = partial.joined(more)
    r = whole.routed_experts
    assert (r.first_row, r.rows, r.version_spans) == (0, 9, [(1, 0), (2, 7)])
    assert np.frombuffer(r.data, np.uint8).reshape(9, LAYERS, K)[:, 0, 0].tolist() == [1] * 7 + [2] * 2
    assert whole.version_spans == [(1, 0), (2, 3)]


def test_a_slow_reader_gets_the_rows_it_missed_in_one_delta():
    prog = Progress()
    prog.extend(TokenDelta(start=0, token_ids=[1], logprobs=[-1.0], version_spans=[(0, 0)],
                           routed_experts=rows(0, 5)))                         # the prefill: the prompt's rows
    first = prog.since(0, 0)
    assert (first.routed_experts.first_row, first.routed_experts.rows) == (0, 5)
    for t in (1, 2, 3):
        prog.extend(TokenDelta(start=t, token_ids=[t + 1], logprobs=[-1.0], version_spans=[(0, t)],
                               routed_experts=rows(4 + t, 1)))
    merged = prog.since(1, 5)                                                 # the reader had token 0, rows 0-4
    assert merged.token_ids == [2, 3, 4] and (merged.routed_experts.first_row, merged.routed_experts.rows) == (5, 3)
    assert prog.since(4, 8).routed_experts is None
