import asyncio

from tests.fake_engine import FakeEngine
from rollout_service.pool.pool import EnginePool
from rollout_service.server.convert import status_to_proto


def pool_with(accepted, drafted, steps, k=3):
    async def make():
        pool = EnginePool([FakeEngine("e0")], max_queue=4)
        await pool.start()
        return pool
    pool = asyncio.run(make())
    pool.telemetry.sample_finished(10, "length", 0.1, 0, 0, drafted, accepted, steps, [accepted] + [0] * (k - 1))
    return pool


def test_slow_speculation_is_reported_as_a_warning():
    pool = pool_with(accepted=3, drafted=30, steps=10)      # mean acceptance length 1.3
    st = status_to_proto(pool, "m", 10, 100, "draft_model", 3, draft_cost=0.25)
    assert abs(st.speculation[0].expected_speedup - 1.3 / 1.75) < 1e-9
    assert st.warnings and "slowing generation" in st.warnings[0]


def test_good_speculation_has_no_warning_and_unknown_cost_gives_no_estimate():
    pool = pool_with(accepted=25, drafted=30, steps=10)     # mean acceptance length 3.5
    st = status_to_proto(pool, "m", 10, 100, "draft_model", 3, draft_cost=0.1)
    assert st.speculation[0].expected_speedup > 2.6 and not st.warnings
    st = status_to_proto(pool, "m", 10, 100, "draft_model", 3)
    assert st.speculation[0].expected_speedup == 0.0 and not st.warnings


def test_expected_speedup_counts_the_drafts_actually_made_under_a_k_schedule():
    """k_by_batch_size drafts fewer than k per step at some batch sizes: the estimate uses drafts per step."""
    pool = pool_with(accepted=5, drafted=10, steps=10)      # 1 draft per step although k = 3
    st = status_to_proto(pool, "m", 10, 100, "eagle3", 3, draft_cost=0.1)
    assert abs(st.speculation[0].expected_speedup - 1.5 / 1.1) < 1e-9 and not st.warnings
