"""bench/frontend_ceiling.py's bookkeeping: the instant engine's streamed deltas make up its sample, and the rack
projection is the rack's rate times CPU seconds per token."""
import asyncio

from rollout_service.engine.types import SeqRequest
from tests.bench_modules import bench_module

fc = bench_module("frontend_ceiling")


def test_instant_engine_streams_one_delta_per_step_that_make_up_the_sample():
    async def main():
        engine = fc.InstantEngine("e0")
        await engine.start()
        got = {0: [], 1: []}
        reqs = [SeqRequest(seq_id=f"s{i}", prompt_token_ids=[1, 2, 3], max_tokens=5, top_logprobs=2, stream=True)
                for i in range(2)]
        results = await asyncio.gather(*(engine.generate(r, got[i].append) for i, r in enumerate(reqs)))
        for i, r in enumerate(results):
            assert [d.start for d in got[i]] == [0, 1, 2, 3, 4]
            assert [t for d in got[i] for t in d.token_ids] == r.token_ids and len(r.token_ids) == 5
            assert [row for d in got[i] for row in d.top_token_ids] == r.top_token_ids and len(r.top_token_ids[0]) == 2
    asyncio.run(main())


def test_projection_is_the_racks_rate_times_cpu_per_token(monkeypatch):
    monkeypatch.setattr(fc, "rack_rate", lambda *a: {"engines": 72, "plain_tok_s_per_engine": 10_000, "best_k": 2,
                                                     "speedup": 2.0, "rack_tok_s": 2_000_000})
    ceiling = {"grpc": {"current": {"cpu_s_per_mtok": {"median": 0.5}}},
               "vllm_stream": {"current": {"cpu_s_per_mtok": {"median": 50.0}}}, "profile": {"arm": "grpc"}}
    path = {"final_top0_flat": {"cpu_s_per_mtok": {"median": 8.0}},
            "final_top5_flat": {"cpu_s_per_mtok": {"median": 9.0}},
            "stream_top0_flat": {"cpu_s_per_mtok": {"median": 14.0}}}
    out = fc.projection(ceiling, path, 256, 0.62, {"cpu_s_per_mtok": {"median": 1.0}})
    for policy in fc.RACK_POLICIES:
        assert out[policy]["processes"]["grpc"] == {"ray_engines": 3.0, "embedded_engines": 17.0}
        assert out[policy]["processes"]["vllm_stream"] == {"ray_engines": 102.0, "embedded_engines": 128.0}
