"""What the `ipc` weight-transfer path moves on a GPU: a trainer process hands its weights to an engine process
on the same GPU by CUDA IPC handles, and the engine copies them into its own buffers (what vLLM's ipc engine does
before loading). Needs PyTorch with CUDA only:

    python perf/gpu_ipc_probe.py [--gb 2] [--repeats 5] [--out bench/results/gpu_ipc_probe.json]

Reports, per repeat, the seconds from the engine receiving the handles to its copies done (open + device-to-device
copy), beside one process's device-to-device copy of the same bytes and a pinned host-to-device copy, as GB/s.
"""
from __future__ import annotations

import argparse
import json
import time


def tensors(gb: float, device: str):
    import torch

    n = int(gb * 1e9 / 2 / 64)                   # 64 tensors of bf16
    return [torch.randn(n, dtype=torch.bfloat16, device=device) for _ in range(64)]


def engine(q_in, q_out, repeats: int):
    import torch

    torch.cuda.init()
    dst = None
    for _ in range(repeats):
        handles = q_in.get()                    # CUDA IPC: the tensors arrive as handles, opened on receipt
        torch.cuda.synchronize()
        t = time.perf_counter()
        src = list(handles)
        if dst is None:
            dst = [torch.empty_like(s) for s in src]
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        q_out.put(time.perf_counter() - t)
        del src, handles


def timed_copies(dst: list, src: list, repeats: int) -> list[float]:
    """Seconds per repeat to copy every tensor of `src` into `dst` (GPU work included)."""
    import torch

    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/gpu_ipc_probe.json")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    mp.set_start_method("spawn")
    src = tensors(args.gb, "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in src)
    q_in, q_out = mp.Queue(), mp.Queue()
    p = mp.Process(target=engine, args=(q_in, q_out, args.repeats))
    p.start()
    ipc = []
    for _ in range(args.repeats):
        q_in.put(src)
        ipc.append(q_out.get(timeout=120))
    p.join(60)
    dst = [torch.empty_like(t) for t in src]
    d2d = timed_copies(dst, src, args.repeats)
    h2d = timed_copies(dst, [t.cpu().pin_memory() for t in src], args.repeats)
    rows = {"device": torch.cuda.get_device_name(0), "bytes": nbytes, "date": time.strftime("%Y-%m-%dT%H:%M"),
            "ipc_s": ipc, "d2d_s": d2d, "h2d_pinned_s": h2d,
            "ipc_gb_per_s_best": nbytes / min(ipc) / 1e9,
            "ipc_gb_per_s_median": nbytes / sorted(ipc)[len(ipc) // 2] / 1e9,
            "d2d_gb_per_s_best": nbytes / min(d2d) / 1e9, "h2d_pinned_gb_per_s_best": nbytes / min(h2d) / 1e9}
    print(json.dumps(rows, indent=1))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
