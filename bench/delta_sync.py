"""Delta weight sync against full pushes, on the bundled GRPO trainer's own steps (issue 56):

    .venv/bin/python bench/delta_sync.py [--steps 10] [--trainer-args "--prompts 4"]

Two services on the default model in bfloat16 (no speculation): the trainer (`rollout-grpo`, its default learning
rate) runs against service A and pushes deltas (rollout_client.delta.WeightDeltas: a full anchor first, then only the
elements that changed); after each of its pushes the same weights go whole to service B (PushWeights, bf16), the order
alternating per step (delta first on odd steps). Per step: elements changed, bytes each way sent, the trainer's push
call until the new version serves (client-side diffing and casting included), the service's own total and pause, and
whether both services' fingerprints agree (the same weights, bit for bit). The encodings considered are recorded too:
zlib level 1 over the delta's bytes (size and time). Goals: bytes_ratio (full / delta) >= 20, time_ratio >= 5, the
delta's pause no longer than the full push's. Writes bench/results/delta_sync.json (with `steps`).
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
import time
import zlib
from pathlib import Path

from harness import services, write_result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trainer-args", default="", help="more rollout-grpo arguments (quoted)")
    ap.add_argument("--out", default=None, help="default bench/results/delta_sync.json")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (the first push is a full one; deltas follow it)")

    import torch
    from rollout_client import RolloutClient
    from rollout_client.delta import fingerprint
    from rollout_client.launcher import run_command
    from trainer_example import train

    policy_dir = run_command("prepare-model")
    tmp = Path(tempfile.mkdtemp(prefix="delta-sync-"))
    extra = ["--dtype", "bfloat16", "--speculation", "none"]
    rows: list[dict] = []
    with services(policy_dir, {"a": extra, "b": extra}, tmp) as up, RolloutClient(up["a"].target) as ca, \
            RolloutClient(up["b"].target) as cb:
        targs = train.parse_args(["--target", up["a"].target, "--engine-dtype", "bfloat16", "--speculation", "none",
                                  "--weight-delta", "on", "--weight-sync", "push", "--steps", str(args.steps),
                                  "--eval-every", str(10 * args.steps), "--eval-size", "8", "--no-save-final",
                                  "--out", str(tmp / "run"), *shlex.split(args.trainer_args)])
        delta_push = train.Trainer.push

        def push_both(trainer, client, sync, version, mode, dtype):
            """The trainer's push (a delta after the first), and the same weights whole to service B."""
            weights = trainer.push_weights()
            out = {}

            def by_delta():
                t = time.perf_counter()
                out["delta"] = delta_push(trainer, client, sync, version, mode, dtype)
                out["delta_s"] = time.perf_counter() - t

            def by_full():
                t = time.perf_counter()
                out["full"] = cb.push_weights(weights, version, mode=mode, dtype=torch.bfloat16)
                out["full_s"] = time.perf_counter() - t
            for f in ((by_delta, by_full) if version % 2 else (by_full, by_delta)):
                f()
            d, full, deltas = out["delta"], out["full"], trainer.deltas
            payload = _delta_bytes(deltas) if deltas.last_kind == "delta" else b""
            t = time.perf_counter()
            packed = len(zlib.compress(payload, 1)) if payload else 0
            zlib_s = time.perf_counter() - t
            rows.append(dict(
                version=version, kind=deltas.last_kind, first="delta" if version % 2 else "full",
                elements=sum(p.numel() for p in trainer.policy.parameters()), changed=deltas.last_changed,
                delta_bytes=deltas.last_bytes, full_bytes=full.num_bytes, zlib1_bytes=packed, zlib1_s=zlib_s,
                delta_push_s=out["delta_s"], full_push_s=out["full_s"], delta_total_s=d.total_s,
                full_total_s=full.total_s, delta_pause_s=d.pause_s, full_pause_s=full.pause_s,
                delta_prepare_s=d.prepare_s, full_prepare_s=full.prepare_s, delta_validate_s=d.validate_s,
                same_weights=d.fingerprint == full.fingerprint == fingerprint(weights, torch.bfloat16)))
            r = rows[-1]
            print(f"v{version} {r['kind']:>5}: changed {r['changed'] / r['elements']:.3%}, "
                  f"bytes {r['delta_bytes'] / 1e6:.1f} MB vs {r['full_bytes'] / 1e6:.1f} MB, "
                  f"push {r['delta_push_s']:.2f} s vs {r['full_push_s']:.2f} s, "
                  f"pause {r['delta_pause_s'] * 1e3:.0f} vs {r['full_pause_s'] * 1e3:.0f} ms, same weights "
                  f"{r['same_weights']}", flush=True)
            return d

        train.Trainer.push = push_both
        try:
            train.run(ca, targs, policy_dir, None, tmp / "run")
        finally:
            train.Trainer.push = delta_push
    report(rows, args)
    return 0


def _delta_bytes(deltas) -> bytes:
    """The last delta's indices and values as sent (for the compression column)."""
    return b"".join((b"" if c.indices is None else c.indices.tobytes()) + c.values.tobytes()
                    for c in deltas.last_changes)


def report(rows: list[dict], args) -> None:
    deltas = [r for r in rows if r["kind"] == "delta"]

    def med(key):
        return statistics.median(r[key] for r in deltas)
    summary = dict(
        steps=len(rows), delta_steps=len(deltas),
        changed_fraction=med("changed") / rows[0]["elements"],
        bytes_ratio=statistics.median(r["full_bytes"] / r["delta_bytes"] for r in deltas),
        time_ratio=statistics.median(r["full_push_s"] / r["delta_push_s"] for r in deltas),
        service_time_ratio=statistics.median(r["full_total_s"] / r["delta_total_s"] for r in deltas),
        pause_ratio=statistics.median(r["delta_pause_s"] / r["full_pause_s"] for r in deltas),
        zlib1_ratio=statistics.median(r["full_bytes"] / r["zlib1_bytes"] for r in deltas),
        zlib1_s=med("zlib1_s"), delta_push_s=med("delta_push_s"), full_push_s=med("full_push_s"),
        delta_prepare_s=med("delta_prepare_s"), full_prepare_s=med("full_prepare_s"),
        all_same_weights=all(r["same_weights"] for r in rows))
    print("\n" + "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    print(f"wrote {write_result('delta_sync', vars(args), summary, rows, args.out)}")


if __name__ == "__main__":
    raise SystemExit(main())
