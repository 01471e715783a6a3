import pytest

from rollout_service.speculation.speedup import (
    expected_speedup,
    mean_acceptance_length,
    per_token_acceptance,
    speedup_bound,
    step_cost,
)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("a", [0.0, 0.1, 0.3, 0.5, 0.8, 0.99])
def test_per_token_acceptance_inverts_the_mean_acceptance_length(a, k):
    assert per_token_acceptance(mean_acceptance_length(a, k), k) == pytest.approx(a, abs=1e-9)


def test_bound_is_the_closed_form_of_the_issue():
    a, k, c = 0.6, 3, 0.05
    assert speedup_bound(a, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (1 + c * k)))
    assert speedup_bound(1.0, 3, 0.0) == 4.0
    assert per_token_acceptance(0.9, 3) == 0.0 and per_token_acceptance(7.0, 3) == 1.0


def test_vllm_acceptance_rate_is_not_the_per_token_acceptance_when_k_exceeds_one():
    # 1000 steps at a = 0.5, k = 3: positions reached 1000, 500, 250; accepted 500 + 250 + 125.
    steps, accepted, drafted = 1000, 875, 3000
    mean_len = 1 + accepted / steps
    assert per_token_acceptance(mean_len, 3) == pytest.approx(0.5)
    assert accepted / drafted < 0.3                       # what vLLM calls the acceptance rate
    assert speedup_bound(0.5, 3, 0.05) == pytest.approx(expected_speedup(mean_len, 3, 0.05))
    assert speedup_bound(accepted / drafted, 3, 0.05) < 0.8 * expected_speedup(mean_len, 3, 0.05)


def test_step_cost_is_one_when_speculation_emits_exactly_its_tokens_per_plain_step():
    assert step_cost(2.0, 50.0, 100.0) == pytest.approx(1.0)
    assert step_cost(2.0, 50.0, 50.0) == pytest.approx(2.0)
