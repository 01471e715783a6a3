"""bench/soak.py's checks and summary (no vLLM): what counts as retriable, which labels are wrong, how growth and
drift are computed, and that a run missing its goals says so."""
import pytest

from tests.bench_modules import bench_module

soak = bench_module("soak")


@pytest.mark.parametrize("code,kind", [("OK", "ok"), ("UNAVAILABLE", "retriable"), ("RESOURCE_EXHAUSTED", "retriable"),
                                       ("ABORTED", "retriable"), ("DEADLINE_EXCEEDED", "retriable"),
                                       ("INVALID_ARGUMENT", "fatal"), ("INTERNAL", "fatal"), ("UNKNOWN", "fatal"),
                                       ("FAILED_PRECONDITION", "fatal"), ("CANCELLED", "fatal"),
                                       ("NOT_FOUND", "fatal")])
def test_retriable_statuses_are_the_contracts(code, kind):
    assert soak.classify(code) == kind


def test_span_checks():
    assert soak.span_problems([(3, 0)], 5, {0, 3}) == []
    assert soak.span_problems([(3, 0), (4, 2)], 5, {3, 4}) == []
    assert soak.span_problems([(3, 0), (5, 2)], 5, {3, 4}) == ["version 5 was never committed"]
    assert soak.span_problems([], 5, None) == ["no version spans"]
    assert soak.span_problems([], 0, None) == []
    assert any("back" in p for p in soak.span_problems([(4, 0), (3, 2)], 5, None))
    assert any("starts at token" in p for p in soak.span_problems([(4, 1)], 5, None))
    assert any("not increasing" in p for p in soak.span_problems([(3, 0), (4, 0)], 5, None))
    assert any("past" in p for p in soak.span_problems([(3, 0), (4, 5)], 5, None))
    assert any("one" in p for p in soak.span_problems([(1, 0), (2, 3)], 5, None, single=True))


def test_a_label_naming_an_uncommitted_version_is_flagged():
    committed = {("policy", "policy"): {0, 1, 2}, ("policy", "adapter:t0"): {0, 1}}
    labels = {("policy", "policy", (1, 2)): 10, ("policy", "policy", (2, 3)): 2, ("policy", "adapter:t0", (1,)): 4,
              ("policy", "adapter:t1", (1,)): 1, ("moe", "policy", (0,)): 3}
    bad = soak.uncommitted(labels, committed)
    # version 3 never committed; adapter t1 and the moe service never committed anything but their start (0)
    assert bad == {("policy", "policy", (2, 3)): 2, ("policy", "adapter:t1", (1,)): 1}
    assert soak.uncommitted({("moe", "policy", (0,)): 3}, {("moe", "policy"): {0}}) == {}


def test_stream_and_topk_checks():
    assert soak.stream_problems([(0, [5, 6]), (2, [7])], [5, 6, 7, 8]) == []
    assert soak.stream_problems([(0, [5, 6]), (3, [7])], [5, 6, 7, 8])       # a gap
    assert soak.stream_problems([(0, [5, 9])], [5, 6, 7])                      # other tokens
    ids, lps = [[7, 3], [2, 7]], [[-0.1, -2.0], [-0.5, -0.9]]
    assert soak.topk_problems([7, 7], [-0.1, -0.9], ids, lps, 2) == []
    assert soak.topk_problems([7, 7], [-0.1, -0.6], ids, lps, 2)               # not its top-k entry
    assert soak.topk_problems([7], [-0.1], ids, lps, 2)                        # rows for 2 tokens, 1 sampled
    assert soak.topk_problems([7, 4], [-0.1, -0.2], ids, lps, 2)               # above its top-1
    assert soak.topk_problems([7, 7], [-0.1, -0.9], [[7, 3], [7, 2]], [[-2.0, -0.1], [-0.9, -0.5]], 2)


def test_growth_and_windows():
    assert soak.windows(10, 0.1, 0.1) == (range(1, 2), range(9, 10))
    assert soak.windows(1, 0.1, 0.1) == (range(0, 1), range(0, 1))
    flat = [1000.0] * 20
    assert soak.growth(flat) == 0.0
    # warm-up excluded: a large first row does not count; the last window's median over the first's
    rising = [5000.0] + [1000.0] * 9 + [1100.0] * 10
    assert soak.growth(rising, warmup=0.1, window=0.2) == pytest.approx(0.1)
    assert soak.growth([None] * 5) is None


def test_growth_is_taken_within_the_last_process():
    # a front end restarted at row 4: its first life's memory is not compared with its second's
    rows = [{"fe_pid": 1 if i < 4 else 2, "rss": 500.0 if i < 4 else 900.0 + (i - 4) * 10} for i in range(14)]
    info = soak.role_growth(rows, "rss", "fe_pid", warmup=0.0, window=0.1)
    assert info["rows"] == 10 and info["of"] == 14
    assert info["growth"] == pytest.approx(990 / 900 - 1, abs=1e-4)
    assert soak.flat({"first": 100, "last": 103}, 4) and not soak.flat({"first": 100, "last": 120}, 4)


def test_p99_drift_leaves_out_fault_rows():
    rows = [{"probe_s": [0.1] * 50 + [0.2]} for _ in range(10)]
    rows[9]["fault"] = True
    rows[9]["probe_s"] = [30.0]                       # a restart's stall
    assert soak.p99_drift(rows, warmup=0.0)["drift"] == 0.0
    rows[8]["probe_s"] = [0.3] * 51                   # a real drift in the last quiet row
    assert soak.p99_drift(rows, warmup=0.0)["drift"] == pytest.approx(0.5)


def test_fault_schedule():
    smoke = soak.fault_schedule(300)
    assert {k for _, k, _ in smoke} == {"frontend_restart", "engine_kill", "trainer_kill", "disconnect"}
    assert [t for t, _, _ in smoke] == sorted(t for t, _, _ in smoke)
    assert all(t >= 75 for t, k, _ in smoke if k in ("frontend_restart", "engine_kill"))
    long = soak.fault_schedule(7200)
    assert max(t for t, _, _ in long) < 0.9 * 7200
    assert sum(k == "engine_kill" for _, k, _ in long) == 2


def _rows(n=20, lost=0, rss_step=0.0):
    return [{"t_s": 60.0 * (i + 1), "policy.fe_rss_mb": 800 + rss_step * i, "policy.fe_pid": 1,
             "policy.engines_rss_mb": 1500.0, "policy.engine_pids": "2 3", "policy.fds": 40, "policy.threads": 20,
             "probe_s": [0.1] * 20} for i in range(n)]


def test_summary_goals_met_and_missed():
    faults = [{"kind": "engine_kill", "recovered": True}, {"kind": "disconnect", "recovered": True}]
    good = soak.summarize(_rows(), {"requests": 100, "samples": 400, "commits": 30}, faults, warmup=0.1)
    assert good["goals_met"] and good["duration_s"] == 1200.0 and good["rss_growth"]["policy.front_end"] == 0.0
    assert good["faults_injected"] == {"engine_kill": 1, "disconnect": 1}
    leaking = soak.summarize(_rows(rss_step=10.0), {}, faults, warmup=0.1)
    assert leaking["goals"]["rss_growth_at_most_5pct"] is False and not leaking["goals_met"]
    lost = soak.summarize(_rows(), {"lost_samples": 3}, faults, warmup=0.1)
    assert lost["goals"]["zero_lost_samples"] is False and not lost["goals_met"]
    unrecovered = soak.summarize(_rows(), {}, faults + [{"kind": "engine_kill", "recovered": False}], warmup=0.1)
    assert unrecovered["goals"]["every_fault_recovered"] is False
