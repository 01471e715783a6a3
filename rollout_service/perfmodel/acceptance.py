"""Per-position acceptance a_1, a_2, ... (draft i accepted given drafts 1..i-1 were): typed, read from a running
service's GetStatus, or from a trainer's metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path


def parse(text: str) -> list[float]:
    """"0.7,0.6,0.55" -> [0.7, 0.6, 0.55]."""
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or any(not 0.0 <= a <= 1.0 for a in out):
        raise SystemExit(f"--acceptance {text!r}: comma-separated values in [0, 1]")
    return out


def conditional(unconditional: list[float]) -> list[float]:
    """Per-position rates of all verify steps (P[draft i accepted]) -> a_i = P[i accepted] / P[i - 1 accepted]."""
    out, prev = [], 1.0
    for p in unconditional:
        out.append(min(1.0, p / prev) if prev > 0 else 0.0)
        prev = p
    return out


def from_status(target: str) -> list[float]:
    """GetStatus of a running service: k_control.acceptance (the controller's per-position measurement), else the
    newest SpeculationStats' per_position_acceptance (unconditional rates, converted)."""
    from rollout_client import RolloutClient

    with RolloutClient(target) as client:
        status = client.status()
    if list(status.k_control.acceptance):
        return list(status.k_control.acceptance)
    if status.speculation and list(status.speculation[-1].per_position_acceptance):
        return conditional(list(status.speculation[-1].per_position_acceptance))
    raise SystemExit(f"{target}: the service has measured no acceptance yet (is speculation on, and has it "
                     "generated?)")


def from_metrics(path: str | Path, last: int = 5) -> list[float]:
    """A trainer's metrics.jsonl: the mean of `draft_acceptance` over the last `last` steps that have it."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    acc = [r["draft_acceptance"] for r in rows if r.get("draft_acceptance")][-last:]
    if not acc:
        raise SystemExit(f"{path}: no step with draft_acceptance")
    n = min(len(a) for a in acc)
    return [sum(a[i] for a in acc) / len(acc) for i in range(n)]
