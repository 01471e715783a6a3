"""Counters the pool keeps for GetStatus and /metrics (one place; the HTTP layer only formats them)."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

WINDOW_S = 60.0


@dataclass
class SpecCounts:
    drafted: int = 0
    accepted: int = 0
    steps: int = 0                                   # verify steps with speculation (if known)
    per_position: list[int] = field(default_factory=list)   # accepted at draft position i (if known)


class Telemetry:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.samples_total = 0
        self.tokens_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)
        self.spec: dict[tuple[int, int], SpecCounts] = {}
        # engine id -> KController.snapshot() (EnginePool.refresh_k_control)
        self.k_control: dict[str, dict] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.m_requests = Counter("rollout_generate_requests", "Generate requests by final status code",
                                  ["code"], registry=r)
        self.m_samples = Counter("rollout_samples", "Samples finished", ["finish_reason"], registry=r)
        self.m_tokens = Counter("rollout_generated_tokens", "Generated tokens", registry=r)
        self.m_restarts = Counter("rollout_engine_restarts", "Engines restarted after dying", ["engine"], registry=r)
        self.m_queue = Gauge("rollout_queue_depth", "Sequences admitted and not finished", registry=r)
        self.m_policy = Gauge("rollout_policy_version", "Serving policy version", registry=r)
        self.m_draft = Gauge("rollout_draft_version", "Serving drafter version", registry=r)
        self.m_latency = Histogram("rollout_sample_seconds", "Time from admission to a sample finishing",
                                   buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120, 300), registry=r)
        self.m_drafted = Counter("rollout_spec_drafted_tokens", "Draft tokens proposed",
                                 ["policy_version", "draft_version"], registry=r)
        self.m_accepted = Counter("rollout_spec_accepted_tokens", "Draft tokens accepted",
                                  ["policy_version", "draft_version"], registry=r)
        self.m_pushes = Counter("rollout_weight_pushes", "Weight pushes by path (stream: PushWeights/UpdateDraft, "
                                "path: LoadWeights, transfer: TransferWeights) and outcome", ["path", "outcome"],
                                registry=r)
        self.m_push_gbps = Gauge("rollout_weight_push_gb_per_second",
                                 "End-to-end rate of the last committed push (call to new version serving)", ["path"],
                                 registry=r)
        self.m_push_pause = Gauge("rollout_weight_push_pause_seconds", "Generation pause of the last committed push",
                                  ["path"], registry=r)
        self.m_transfer_world = Gauge("rollout_weight_transfer_world_size",
                                      "Ranks of the weight-transfer group (0: none set up)", registry=r)
        self.m_session_requests = Counter(
            "rollout_session_requests", "Requests with a session key by how they were routed: hit (the session's "
            "engine), moved_unavailable / moved_overloaded (least-loaded instead; the session moved), started (a "
            "session not known)", ["outcome"], registry=r)
        self.m_sessions = Gauge("rollout_sessions", "Sessions remembered for routing", registry=r)
        self.m_precision = Gauge("rollout_served_precision", "1 under the served precision (engine.quantization; "
                                 "Status.quantization): the policy's and the drafter's, the engine's float dtype",
                                 ["method", "drafter_method", "dtype", "batch_invariant"], registry=r)
        self.last_push: dict = {}                      # path, target, bytes, seconds, pause_s of the last commit
        r.register(_KControlCollector(self))
        self.patches_of = list                        # -> engine/patches.py's report (EnginePool sets it)
        r.register(_PatchCollector(self))

    def served_precision(self, p: dict) -> None:
        """Status.quantization's fields (engine/quantize.py describe) as rollout_served_precision."""
        self.m_precision.labels(p["method"], p["drafter_method"], p["dtype"], str(p["batch_invariant"]).lower()).set(1)

    def push_committed(self, path: str, target: str, num_bytes: int, seconds: float, pause_s: float) -> None:
        self.m_pushes.labels(path, "committed").inc()
        self.m_push_gbps.labels(path).set(num_bytes / seconds / 1e9 if seconds > 0 else 0.0)
        self.m_push_pause.labels(path).set(pause_s)
        self.last_push = dict(path=path, target=target, num_bytes=num_bytes, seconds=seconds, pause_s=pause_s)

    def push_failed(self, path: str) -> None:
        self.m_pushes.labels(path, "failed").inc()

    def transfer_group(self, world_size: int) -> None:
        self.m_transfer_world.set(world_size)

    def session_routed(self, outcome: str, sessions: int) -> None:
        self.m_session_requests.labels(outcome).inc()
        self.m_sessions.set(sessions)

    def engine_restarted(self, engine_id: str) -> None:
        self.m_restarts.labels(engine=engine_id).inc()

    def sample_finished(self, n_tokens: int, finish_reason: str, latency_s: float, policy_version: int,
                        draft_version: int, drafted: int, accepted: int, steps: int = 0,
                        accepted_per_pos: list[int] | None = None) -> None:
        now = time.monotonic()
        self.samples_total += 1
        self.tokens_total += n_tokens
        self._recent.append((now, n_tokens))
        self.m_samples.labels(finish_reason).inc()
        self.m_tokens.inc(n_tokens)
        self.m_latency.observe(latency_s)
        if drafted:
            c = self.spec.setdefault((policy_version, draft_version), SpecCounts())
            c.drafted += drafted
            c.accepted += accepted
            c.steps += steps
            per_pos = accepted_per_pos or []
            if len(c.per_position) < len(per_pos):
                c.per_position += [0] * (len(per_pos) - len(c.per_position))
            for i, a in enumerate(per_pos):
                c.per_position[i] += a
            labels = (str(policy_version), str(draft_version))
            self.m_drafted.labels(*labels).inc(drafted)
            self.m_accepted.labels(*labels).inc(accepted)

    def rates(self) -> tuple[float, float]:
        """(tokens/s, samples/s) over the last WINDOW_S seconds (or since start, if shorter)."""
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > WINDOW_S:
            self._recent.popleft()
        span = min(WINDOW_S, max(now - self.started, 1e-9))
        return sum(t for _, t in self._recent) / span, len(self._recent) / span

    def uptime(self) -> float:
        return time.monotonic() - self.started


class _PatchCollector:
    """Every vLLM patch of engine/patches.py, 1 under its state: rollout_vllm_patch{name, state}."""

    def __init__(self, telemetry: Telemetry):
        self.t = telemetry

    def collect(self):
        g = GaugeMetricFamily("rollout_vllm_patch", "The project's vLLM patches by state (applied, not needed, "
                              "skipped), as the first ready engine reports them", labels=["name", "state"])
        for p in self.t.patches_of():
            g.add_metric([p["name"], p["state"]], 1.0)
        yield g


class _KControlCollector:
    """The k controller's view (engine.speculation.k_control = "auto") in Prometheus form: a histogram of the k
    each engine step drafted, the step time measured by batch-size bucket and k, and expected and realised
    speedup by bucket, labelled with the drafter version they were measured for."""

    def __init__(self, telemetry: Telemetry):
        self.t = telemetry

    def collect(self):
        hist = HistogramMetricFamily("rollout_spec_k_chosen", "Engine steps by the k they drafted (k controller)",
                                     labels=["engine"])
        step = GaugeMetricFamily("rollout_spec_step_seconds", "Measured engine step time by batch size and k",
                                 labels=["engine", "batch_sizes", "k"])
        speed = GaugeMetricFamily("rollout_spec_controller_speedup", "Speedup against k = 0 at the chosen k",
                                  labels=["engine", "batch_sizes", "draft_version", "kind"])
        chosen = GaugeMetricFamily("rollout_spec_k_chosen_now", "k the controller currently picks",
                                   labels=["engine", "batch_sizes"])
        off = GaugeMetricFamily("rollout_spec_drafter_off", "1 where drafting loses and the controller switched the "
                                "drafter off (k = 0, nothing of the drafter run)", labels=["engine", "batch_sizes"])
        accept = GaugeMetricFamily("rollout_spec_policy_acceptance", "The controller's acceptance estimate per draft "
                                   "position for each policy (the base: policy=\"\", a LoRA adapter: its name)",
                                   labels=["engine", "policy", "position"])
        for engine, snap in sorted(self.t.k_control.items()):
            for policy, row in sorted(snap.get("policies", {}).items()):
                for i, a in enumerate(row["acceptance"], 1):
                    if a is not None:
                        accept.add_metric([engine, policy, str(i)], a)
            counts, cum, buckets = snap["steps_by_k"], 0, []
            for k, n in enumerate(counts):
                cum += n
                buckets.append((str(k), cum))
            buckets.append(("+Inf", cum))
            hist.add_metric([engine], buckets, sum_value=sum(k * n for k, n in enumerate(counts)))
            for row in snap["buckets"]:
                chosen.add_metric([engine, row["batch"]], row["chosen_k"])
                off.add_metric([engine, row["batch"]], float(bool(row.get("drafter_off"))))
                for k, ms in enumerate(row["step_ms"]):
                    if ms is not None:
                        step.add_metric([engine, row["batch"], str(k)], ms / 1e3)
                for kind in ("expected", "realized"):
                    if row[f"{kind}_speedup"] is not None:
                        speed.add_metric([engine, row["batch"], str(snap["draft_version"]), kind],
                                         row[f"{kind}_speedup"])
        yield from (hist, step, speed, chosen, off, accept)
