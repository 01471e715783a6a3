"""The words of the wire, client side, named once: the contract's in-flight modes, weight targets, finish
reasons and tensor dtype names, with their proto enum values. Every module of the client takes them from here
(the service names the same words in rollout_service/wire.py; this package does not depend on it)."""
from __future__ import annotations

from rollout_client.api import pb

MODES = {m: pb.InFlightMode.Value(f"IN_FLIGHT_{m.upper()}") for m in ("abort", "wait", "keep")}
TARGETS = {t: pb.WeightTarget.Value(f"TARGET_{t.upper()}") for t in ("policy", "drafter", "adapter")}
TARGET_NAMES = {v: t for t, v in TARGETS.items()}
FINISH_REASONS = {pb.FinishReason.Value(f"FINISH_REASON_{r.upper()}"): r for r in ("stop", "length", "abort")}
DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}   # torch -> wire
