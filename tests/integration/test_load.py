"""Load on the shared real service: many concurrent clients mixing Generate, GetStatus and weight pushes.
Bounded in count and time, loopback only. Every accepted request gets exactly its samples, every rejected
one a clear status, pushes commit in order, and the service process's memory stays flat."""
import random
import threading
import time

import grpc
import psutil
from safetensors.torch import load_file

from rollout_client import RolloutClient

CLIENTS = 8
ROUNDS = 12
PUSHES = 6


def test_mixed_load_loses_nothing_and_memory_stays_flat(service, client, tiny_model):
    norm = {"model.norm.weight": load_file(str(tiny_model / "model.safetensors"))["model.norm.weight"]}
    proc = psutil.Process(service.proc.pid)
    tally = {"accepted": 0, "samples": 0, "rejected": {}, "status": 0, "pushes": 0}
    problems, lock = [], threading.Lock()

    def generator(i: int):
        rng = random.Random(i)
        with RolloutClient(service.target) as c:
            for r in range(ROUNDS):
                prompts = [[1] + [rng.randint(2, 500) for _ in range(rng.randint(1, 12))]
                           for _ in range(rng.randint(1, 4))]
                n = rng.randint(1, 4)
                try:
                    groups = c.generate_all(prompts, n=n, max_tokens=rng.randint(4, 24),
                                            request_id=f"load-{i}-{r}", seed=rng.getrandbits(31))
                except grpc.RpcError as e:
                    ok = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue" in e.details()
                    with lock:
                        tally["rejected"][e.code().name] = tally["rejected"].get(e.code().name, 0) + 1
                        if not ok:
                            problems.append(f"client {i}: unexpected {e.code()}: {e.details()}")
                    continue
                got = sorted((s.prompt_index, s.sample_index) for g in groups for s in g)
                want = sorted((p, s) for p in range(len(prompts)) for s in range(n))
                with lock:
                    tally["accepted"] += 1
                    tally["samples"] += len(got)
                    if got != want:
                        problems.append(f"client {i} round {r}: samples {got} != {want}")
                if r % 3 == 0:
                    c.status()
                    with lock:
                        tally["status"] += 1

    def pusher():
        with RolloutClient(service.target) as c:
            for k in range(PUSHES):
                v = c.status().policy_version + 1
                res = c.push_weights(norm, v, partial=True, mode="keep" if k % 2 else "wait")
                if res.version != v:
                    problems.append(f"push {v} committed as {res.version}")
                tally["pushes"] += 1
                time.sleep(0.2)

    def run_round(offset: int) -> float:
        threads = [threading.Thread(target=generator, args=(offset + i,)) for i in range(CLIENTS)]
        threads.append(threading.Thread(target=pusher))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a client hung"
        return time.monotonic() - t0

    run_round(0)                                        # warm-up: allocator, caches, compiled paths
    rss_warm = proc.memory_info().rss
    elapsed = sum(run_round(100 * k) for k in (1, 2))
    rss_end = proc.memory_info().rss
    assert not problems, problems[:10]
    assert tally["accepted"] > 0 and tally["pushes"] == 3 * PUSHES
    growth_mb = (rss_end - rss_warm) / 2**20
    print(f"\nload: {3 * CLIENTS} client threads x {ROUNDS} requests + {3 * PUSHES} pushes: "
          f"{tally['accepted']} accepted ({tally['samples']} samples, all exact), rejected {tally['rejected']}, "
          f"{tally['status']} status calls; last two rounds {elapsed:.1f} s; service RSS {rss_warm / 2**20:.0f} MB "
          f"-> {rss_end / 2**20:.0f} MB ({growth_mb:+.1f} MB)")
    assert growth_mb < 64, f"service memory grew {growth_mb:.0f} MB over two identical rounds"
    assert client.status().queue_depth == 0
