"""Weight pushes into a running service over loopback, side by side in one run:

    .venv/bin/python bench/weight_push.py [--model DIR] [--repeats 3] [--reloads shadow,in_place]

For each commit path (engine.weight_reload: "shadow" prepares the new weights beside the served ones while
generating and pauses only to swap them in; "in_place" loads them while paused), a service of its own:
- PushWeights of the whole model (bf16, as a trainer would send it), service idle: end-to-end GB/s and
  the server's phase timings (receive, validate, prepare, apply, pause), with the client's sha256 in the
  trailer (the default: hashed while streaming) and in the header (hashed before), interleaved;
- PushWeights in keep mode while a batch of generation is in flight: the pause window;
- LoadWeights of the same tensors from a safetensors file on local disk;
and this machine's memcpy bandwidth (a torch copy of the same byte count), as the ceiling; and the
service's memory (USS of the server and its engine processes) before the first push and after the last,
which stays flat unless a commit leaks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def memcpy_gbps(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def tree_uss_gb(pid: int) -> float:
    """Unique memory of process `pid` and all its descendants (server, engine core, worker), in GB."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for p in [root] + root.children(recursive=True):
        try:
            total += p.memory_full_info().uss
        except psutil.Error:
            pass
    return total / 1e9


def run(model_dir: str, model, state: dict, reload: str, repeats: int) -> dict:
    from rollout_client import RolloutClient
    from rollout_client.launcher import ServiceProcess
    from safetensors.torch import save_file

    from rollout_service.models import cache_dir

    print(f"\n== engine.weight_reload = {reload}", flush=True)
    with ServiceProcess(model_dir, log_path=f"bench/results/weight_push-{reload}.log",
                        extra_args=["--weight-reload", reload]) as svc, RolloutClient(svc.target) as client:
        version = client.status().policy_version
        uss_before = tree_uss_gb(svc.proc.pid)
        version += 1
        t = time.perf_counter()
        client.push_weights(model, version, mode="wait")
        print(f"first push after start-up (not counted below): {time.perf_counter() - t:.2f} s")
        rows = {"trailer": [], "header": []}         # where the client puts the sha256; interleaved runs
        for _ in range(repeats):
            for checksum, got in rows.items():
                version += 1
                t = time.perf_counter()
                r = client.push_weights(model, version, mode="wait", checksum=checksum)
                got.append((time.perf_counter() - t, r))
        nbytes = rows["trailer"][0][1].num_bytes
        medians = {k: statistics.median(w for w, _ in v) for k, v in rows.items()}
        med = medians["trailer"]
        for checksum, got in rows.items():
            m = medians[checksum]
            print(f"PushWeights (idle, wait mode, sha256 in the {checksum}), {repeats} runs: end-to-end "
                  f"{nbytes / m / 1e9:.2f} GB/s (median {m:.2f} s until the new version serves)")
            for w, r in got:
                print(f"  wall {w:.2f} s | receive {r.receive_s:.2f} validate {r.validate_s:.2f} prepare "
                      f"{r.prepare_s:.2f} apply {r.apply_s:.3f} pause {r.pause_s:.3f} total {r.total_s:.2f} s")
        print(f"sha256 in the trailer / in the header: push time {med / medians['header']:.2f}")

        prompts = [[1, 9690, 198, 2683, 359, 100 + i] for i in range(16)]
        pauses = []
        for _ in range(repeats):
            out = {}

            def gen():
                out["n"] = len(list(client.generate(prompts, n=4, max_tokens=128, ignore_eos=True, temperature=1.0)))
            th = threading.Thread(target=gen)
            th.start()
            time.sleep(3.0)
            version += 1
            r = client.push_weights(model, version, mode="keep")
            th.join()
            pauses.append(r.pause_s)
            print(f"  keep mode with 64 sequences in flight: pause {r.pause_s:.3f} s (apply {r.apply_s:.3f} s; "
                  f"prepared while generating: {r.prepare_s:.2f} s), {out['n']} samples finished")
        pause = statistics.median(pauses)
        print(f"PushWeights keep mode: median pause window {pause:.3f} s (goal < 0.5 s)")

        # inside the service's cache directory: LoadWeights' default --weights-root
        cache_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as d:
            save_file(state, os.path.join(d, "model.safetensors"))
            lw = []
            for _ in range(repeats):
                version += 1
                t = time.perf_counter()
                r = client.load_weights(d, version)
                lw.append(time.perf_counter() - t)
            med_l = statistics.median(lw)
            print(f"LoadWeights from local disk: {r.num_bytes / med_l / 1e9:.2f} GB/s (median {med_l:.2f} s; "
                  f"prepare {r.prepare_s:.2f} s, apply {r.apply_s:.3f} s, pause {r.pause_s:.3f} s)")
        uss_after = tree_uss_gb(svc.proc.pid)
        print(f"service memory (USS, server + engine processes): {uss_before:.2f} GB before the first push, "
              f"{uss_after:.2f} GB after {4 * repeats + 1} commits")
        return dict(nbytes=nbytes, push_s=med, push_gbps=nbytes / med / 1e9, keep_pause=pause, load_s=med_l,
                    load_gbps=nbytes / med_l / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reloads", default="shadow,in_place")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.cli import resolve_model

    model_dir = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    print(f"model {model_dir}: {len(state)} tensors, {nbytes / 1e6:.1f} MB (bf16; tied lm_head sent once)")
    print(f"memcpy of {nbytes / 1e6:.0f} MB on this machine: {memcpy_gbps(nbytes):.2f} GB/s")
    results = {r: run(model_dir, model, state, r, args.repeats) for r in args.reloads.split(",")}

    print("\nweight_reload  push GB/s  push s  keep-mode pause s  LoadWeights GB/s")
    for r, x in results.items():
        print(f"{r:<13} {x['push_gbps']:>10.2f} {x['push_s']:>7.2f} {x['keep_pause']:>18.3f} {x['load_gbps']:>17.2f}")
    if {"shadow", "in_place"} <= results.keys():
        s, i = results["shadow"], results["in_place"]
        print(f"shadow / in_place: keep-mode pause {s['keep_pause'] / i['keep_pause']:.3f}, "
              f"push time {s['push_s'] / i['push_s']:.2f}")


if __name__ == "__main__":
    main()
