"""Policy pushes by every path, side by side in one run (issue 28):

    .venv/bin/python bench/weight_transfer.py [--repeats 3] [--big-gb 2.0] [--skip-big]

For the default model (SmolLM2-135M, pushed in bf16: 269 MB) and a synthetic Llama of at least --big-gb GB (bf16,
built here in seconds), one service each (weight_reload shadow), the paths interleaved per round (A, B, A, B):
- `push_weights`: the gRPC PushWeights stream (wait mode, service idle);
- `transfer`: WeightSync over the gloo weight-transfer group (InitWeightTransfer once, then TransferWeights);
each as end-to-end GB/s (the trainer's call until the new version serves, as the client sees it) and the
generation pause; then, on the default model only, the pause of each path in keep mode with 64 sequences in
flight; and a memcpy of the same byte count on this machine, the ceiling. Rows go to
bench/results/weight_transfer.json (method, model, bytes, seconds, gb_per_s, pause_ms, memcpy_gb_per_s, date).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from harness import logs_dir, services, write_result
from weight_push import memcpy_gbps  # bench/ is the script's directory


def build_big(out: Path, gb: float, tokenizer_from: str) -> Path:
    """A random Llama of about `gb` GB in bf16 (hidden 2048, 16 heads of 128, SmolLM2's tokenizer), written as
    safetensors directly (no float32 model in memory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, inter, vocab = 2048, 5632, 49152
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    layers = max(1, round((gb * 1e9 / 2 - 2 * vocab * hidden) / per_layer))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                         tie_word_embeddings=False, torch_dtype="bfloat16", rope_theta=10000.0)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
             for k, s in shapes.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    return out


def load_state(model_dir: str) -> dict:
    from safetensors.torch import load_file

    import torch

    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}


def measure(model_dir: str, label: str, repeats: int, dtype: str, keep: bool) -> list[dict]:
    from rollout_client import RolloutClient
    from rollout_client.transfer import WeightSync

    state = load_state(model_dir)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    ceiling = memcpy_gbps(nbytes)
    print(f"\n== {label}: {len(state)} tensors, {nbytes / 1e9:.2f} GB (bf16); memcpy here {ceiling:.2f} GB/s",
          flush=True)
    rows: list[dict] = []
    args = ["--weight-reload", "shadow", "--dtype", dtype, "--kv-cache-gb", "1"]
    with services(model_dir, {label: args}, logs_dir("weight-transfer")) as up, \
            RolloutClient(up[label].target) as client:
        sync = WeightSync(client)
        t = time.perf_counter()
        sync.connect(timeout=300)
        print(f"InitWeightTransfer (group of {sync.world_size}): {time.perf_counter() - t:.2f} s", flush=True)
        version = client.status().policy_version

        def push(method: str, mode: str = "wait"):
            nonlocal version
            version += 1
            t = time.perf_counter()
            if method == "push_weights":
                r = client.push_weights(state, version, mode=mode)
            else:
                r = sync.push(state, version, mode=mode)
            return time.perf_counter() - t, r
        for method in ("push_weights", "transfer"):          # warm-up, not counted
            w, _ = push(method)
            print(f"first {method} (not counted): {w:.2f} s", flush=True)
        got: dict[str, list] = {"push_weights": [], "transfer": []}
        for _ in range(repeats):
            for method in got:
                w, r = push(method)
                got[method].append((w, r))
                print(f"  {method:<12} {nbytes / w / 1e9:6.2f} GB/s  wall {w:.2f} s | receive {r.receive_s:.2f} "
                      f"prepare {r.prepare_s:.2f} apply {r.apply_s:.3f} pause {r.pause_s:.3f}", flush=True)
        for method, runs in got.items():
            w = statistics.median(x for x, _ in runs)
            pause = statistics.median(r.pause_s for _, r in runs)
            rows.append(dict(method=method, model=label, mode="wait", bytes=nbytes, seconds=round(w, 4),
                             gb_per_s=round(nbytes / w / 1e9, 3), pause_ms=round(pause * 1e3, 1),
                             memcpy_gb_per_s=round(ceiling, 2)))
        if keep:
            prompts = [[1, 9690, 198, 2683, 359, 100 + i] for i in range(16)]
            pauses: dict[str, list] = {"push_weights": [], "transfer": []}
            for _ in range(repeats):
                for method in pauses:
                    th = threading.Thread(target=lambda: list(client.generate(
                        prompts, n=4, max_tokens=96, ignore_eos=True, temperature=1.0)))
                    th.start()
                    time.sleep(2.0)
                    w, r = push(method, "keep")
                    th.join()
                    pauses[method].append((w, r.pause_s))
                    print(f"  keep mode, 64 sequences in flight: {method:<12} pause {r.pause_s * 1e3:.0f} ms "
                          f"(wall {w:.2f} s)", flush=True)
            for method, runs in pauses.items():
                w = statistics.median(x for x, _ in runs)
                rows.append(dict(method=method, model=label, mode="keep", bytes=nbytes, seconds=round(w, 4),
                                 gb_per_s=round(nbytes / w / 1e9, 3),
                                 pause_ms=round(statistics.median(p for _, p in runs) * 1e3, 1),
                                 memcpy_gb_per_s=round(ceiling, 2)))
        sync.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big-gb", type=float, default=2.0)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--out", default=None, help="default bench/results/weight_transfer.json")
    args = ap.parse_args()
    from rollout_service.cli import resolve_model

    default = resolve_model(None)
    rows = measure(default, "smollm2-135m", args.repeats, "float32", keep=True)
    if not args.skip_big:
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            big = build_big(Path(d) / "big", args.big_gb, default)
            print(f"\nbuilt the synthetic model in {time.perf_counter() - t:.0f} s", flush=True)
            rows += measure(str(big), f"llama-{args.big_gb:g}gb", args.repeats, "bfloat16", keep=False)
    print("\nmodel            mode  method        GB/s   seconds  pause ms  memcpy GB/s")
    for r in rows:
        print(f"{r['model']:<16} {r['mode']:<5} {r['method']:<12} {r['gb_per_s']:6.2f} {r['seconds']:8.2f} "
              f"{r['pause_ms']:9.1f} {r['memcpy_gb_per_s']:12.2f}")
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["method"]: r for r in rows if r["model"] == model and r["mode"] == "wait"}
        print(f"{model}: transfer / push_weights = {by['transfer']['gb_per_s'] / by['push_weights']['gb_per_s']:.2f}x")
    print(f"wrote {write_result('weight_transfer', vars(args), rows, out=args.out)}")


if __name__ == "__main__":
    main()
