"""Internal structs -> proto messages (the servicer stays thin)."""
from __future__ import annotations

from itertools import chain   # top-k rows, flattened as the proto carries them (row-major)

from rollout_service.api import pb
from rollout_service.config import MODEL_FREE_METHODS
from rollout_service.errors import invalid, invalid_field
from rollout_service.weights.service import Chunk, Header, PushOutcome, Trailer
from rollout_service.weights.transfer import Meta
from rollout_service.engine.base import EngineState
from rollout_service.engine.types import Routes
from rollout_service.model_info import MoeShape
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.requests import IndexedDelta, IndexedResult
from rollout_service.speculation.speedup import expected_speedup, measured_mean_acceptance_length
from rollout_service.wire import DEFAULT_IN_FLIGHT, DEFAULT_TARGET, FINISH_REASONS, IN_FLIGHT_MODES, TARGETS

# rollout_service.wire's names <-> the proto's enum values (IN_FLIGHT_KEEP, TARGET_DRAFTER, FINISH_REASON_STOP, ...)
FINISH = {r: pb.FinishReason.Value(f"FINISH_REASON_{r.upper()}") for r in FINISH_REASONS}
MODES = {pb.IN_FLIGHT_UNSPECIFIED: DEFAULT_IN_FLIGHT,
         **{pb.InFlightMode.Value(f"IN_FLIGHT_{m.upper()}"): m for m in IN_FLIGHT_MODES}}
TARGET_ENUM = {t: pb.WeightTarget.Value(f"TARGET_{t.upper()}") for t in TARGETS}
TARGET_NAMES = {pb.TARGET_UNSPECIFIED: DEFAULT_TARGET, **{v: t for t, v in TARGET_ENUM.items()}}
STATE = {
    EngineState.STARTING: pb.ENGINE_STATE_STARTING, EngineState.READY: pb.ENGINE_STATE_READY,
    EngineState.PAUSED: pb.ENGINE_STATE_PAUSED, EngineState.UNHEALTHY: pb.ENGINE_STATE_UNHEALTHY,
    EngineState.STOPPED: pb.ENGINE_STATE_STOPPED,
}


def sample_to_proto(item: IndexedResult, prompt_ids: list[int], send_prompt: bool, with_text: bool) -> pb.Sample:
    r = item.result
    return pb.Sample(
        prompt_index=item.prompt_index, sample_index=item.sample_index, token_ids=r.token_ids,
        logprobs=r.logprobs, finish_reason=FINISH[r.finish_reason], stop_string=r.stop_string,
        policy_version=r.policy_version,
        version_spans=[pb.VersionSpan(policy_version=v, first_token=t) for v, t in r.version_spans],
        draft_version=r.draft_version, num_drafted=r.num_drafted, num_accepted=r.num_accepted,
        text=r.text if with_text else "", num_prompt_tokens=len(prompt_ids),
        prompt_token_ids=prompt_ids if send_prompt else [],
        top_token_ids=chain.from_iterable(r.top_token_ids),
        top_logprobs=chain.from_iterable(r.top_logprobs),
        num_cached_tokens=r.num_cached_tokens,
        routed_experts=routes_to_proto(r.routed_experts),
    )


def message_to_proto(m) -> pb.AssistantMessage:
    """chat.parse.Message -> AssistantMessage."""
    out = pb.AssistantMessage(tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                          for c in m.tool_calls])
    if m.content is not None:
        out.content = m.content
    if m.reasoning is not None:
        out.reasoning = m.reasoning
    return out


def routes_to_proto(r: Routes | None) -> pb.RoutedExperts | None:
    if r is None:
        return None
    return pb.RoutedExperts(ids=r.data, shape=[r.rows, r.layers, r.top_k], dtype=r.dtype, first_row=r.first_row,
                            version_spans=[pb.VersionSpan(policy_version=v, first_token=t) for v, t in r.version_spans])


def delta_to_proto(item: IndexedDelta, num_prompt_tokens: int) -> pb.Sample:
    """New tokens of an unfinished sample (GenerateRequest.stream_tokens): a Sample with delta set."""
    d = item.delta
    return pb.Sample(
        prompt_index=item.prompt_index, sample_index=item.sample_index, token_ids=d.token_ids, logprobs=d.logprobs,
        policy_version=d.version_spans[0][0] if d.version_spans else 0,
        version_spans=[pb.VersionSpan(policy_version=v, first_token=t) for v, t in d.version_spans],
        num_prompt_tokens=num_prompt_tokens, delta=True, delta_start=d.start,
        top_token_ids=chain.from_iterable(d.top_token_ids),
        top_logprobs=chain.from_iterable(d.top_logprobs),
        routed_experts=routes_to_proto(d.routed_experts),
    )


def k_control_to_proto(mode: str, snapshots: dict[str, dict]) -> pb.KControl:
    """The engines' controller snapshots (pool.telemetry.k_control) -> KControl."""
    out = pb.KControl(mode=mode)
    if not snapshots:
        return out
    width = max(len(s["steps_by_k"]) for s in snapshots.values())
    out.steps_by_k.extend(sum(s["steps_by_k"][k] for s in snapshots.values() if k < len(s["steps_by_k"]))
                          for k in range(width))
    first = snapshots[min(snapshots)]
    out.acceptance.extend(a for a in first["acceptance"] if a is not None)
    out.draft_version = first["draft_version"]
    out.drafter_off_steps = sum(s.get("off_steps", 0) for s in snapshots.values())
    for engine, snap in sorted(snapshots.items()):
        for row in snap["buckets"]:
            out.choices.add(engine=engine, batch_sizes=row["batch"], chosen_k=row["chosen_k"],
                            step_ms=[x or 0.0 for x in row["step_ms"]],
                            expected_speedup=row["expected_speedup"] or 0.0,
                            realized_speedup=row["realized_speedup"] or 0.0,
                            drafter_off=bool(row.get("drafter_off")))
    return out


def status_to_proto(pool: EnginePool, model: str, vocab_size: int, max_model_len: int,
                    spec_method: str = "none", k: int = 0, draft_cost: float = -1.0,
                    k_mode: str = "none", moe: MoeShape | None = None, routes: str = "") -> pb.Status:
    """moe: the policy's routing shape (None: dense); routes: how its routes are captured ("": not captured)."""
    t = pool.telemetry
    tok_s, smp_s = t.rates()
    spec, warnings = [], []
    cost = 0.0 if spec_method in MODEL_FREE_METHODS else draft_cost
    for (pv, dv), c in sorted(t.spec.items()):
        rate = c.accepted / c.drafted if c.drafted else 0.0
        mean_len = measured_mean_acceptance_length(c.accepted, c.steps)
        drafts = c.drafted / c.steps if c.steps else 0.0   # k per verify step, or less under k_by_batch_size
        expected = expected_speedup(mean_len, drafts, cost) if cost >= 0 and c.steps else 0.0
        if cost >= 0 and c.steps and expected < 1.0 and (pv, dv) == (pool.policy_version, pool.draft_version):
            warnings.append(f"speculation is slowing generation: mean acceptance length {mean_len:.2f} with "
                            f"{drafts:.2g} drafts per step and drafter cost {cost:.2f} gives {expected:.2f}x; use a "
                            "better drafter, a smaller k, k 0 at the batch sizes where it loses (k_by_batch_size), "
                            "or no speculation")
        spec.append(pb.SpeculationStats(
            policy_version=pv, draft_version=dv, num_drafted=c.drafted, num_accepted=c.accepted,
            acceptance_rate=rate, mean_acceptance_length=mean_len,
            per_position_acceptance=[a / c.steps for a in c.per_position] if c.steps else [],
            expected_speedup=expected))
    patches = pool.patch_report()
    for p in patches:
        if p["state"] == "skipped" and p["without"]:
            warnings.append(f"vLLM patch {p['name']} skipped ({p['reason']}): {p['without']}")
    return pb.Status(
        patches=[pb.PatchState(name=p["name"], state=p["state"], reason=p["reason"], serves=p["serves"],
                               without=p["without"]) for p in patches],
        model=model, policy_version=pool.policy_version, draft_version=pool.draft_version,
        speculation_method=spec_method, num_speculative_tokens=k,
        engines=[pb.EngineStatus(id=e.id, state=STATE[e.state], location=e.location,
                                 running_sequences=pool.load[e.id], policy_version=e.policy_version,
                                 draft_version=e.draft_version, samples_finished=pool.finished[e.id],
                                 restarts=e.restarts, sessions=pool.sessions.per_engine.get(e.id, 0))
                 for e in pool.engines],
        queue_depth=pool.depth, queue_capacity=pool.max_queue, tokens_per_second=tok_s,
        samples_per_second=smp_s, speculation=spec, ready=pool.ready, uptime_s=t.uptime(),
        samples_total=t.samples_total, tokens_total=t.tokens_total, vocab_size=vocab_size,
        max_model_len=max_model_len, warnings=warnings, k_control=k_control_to_proto(k_mode, t.k_control),
        sessions=session_stats_to_proto(pool.sessions),
        durability=pb.Durability(state_dir=str(pool.committed.state_dir) if pool.committed.durable else "",
                                 restored_policy_version=pool.committed.restored["policy"],
                                 restored_draft_version=pool.committed.restored["drafter"]),
        moe=pb.MoeInfo(num_experts=moe.num_experts, top_k=moe.top_k, num_layers=moe.num_layers, capture=routes)
        if moe else None,
        adapters=[adapter_to_proto(a) for _, a in sorted(pool.adapters.adapters.items()) if not a.unloading],
        adapter_limits=adapter_limits_to_proto(pool.adapters.cfg) if pool.adapters.enabled else None,
        policy_fingerprint=pool.committed.known_content_fingerprint("policy", pool.policy_version),
        draft_fingerprint=pool.committed.known_content_fingerprint("drafter", pool.draft_version),
    )


def adapter_to_proto(a) -> pb.AdapterStatus:
    """pool.adapters.Adapter -> AdapterStatus."""
    latest = a.versions.get(a.latest)
    return pb.AdapterStatus(
        name=a.name, version=a.latest, loaded_versions=sorted(a.versions), rank=latest.rank if latest else 0,
        num_bytes=latest.num_bytes if latest else 0, target_modules=latest.modules if latest else [],
        running_sequences=a.running, samples_total=a.samples_total, tokens_total=a.tokens_total,
        num_drafted=a.num_drafted, num_accepted=a.num_accepted, tenant=a.tenant)


def adapter_limits_to_proto(cfg) -> pb.AdapterLimits:
    return pb.AdapterLimits(max_adapters=cfg.max_adapters, max_rank=cfg.max_rank,
                            max_bytes=int(cfg.max_adapter_mb * (1 << 20)), versions_kept=cfg.versions_kept,
                            max_loras_per_batch=cfg.per_batch())


def session_stats_to_proto(table) -> pb.SessionStats:
    c = table.counts
    return pb.SessionStats(sessions=len(table), hits=c["hit"], moved_unavailable=c["moved_unavailable"],
                           moved_overloaded=c["moved_overloaded"], started=c["started"], evicted=table.evicted)


def target_and_mode(target: int, in_flight: int, where: str) -> tuple[str, str]:
    """Enum values from the wire; an unknown one (a newer client, a corrupt message) is INVALID_ARGUMENT."""
    rpc, _, message = where.rpartition(": ")          # "LoadWeights: request": the RPC and the message
    prefix = f"{message}."
    if target not in TARGET_NAMES:
        raise invalid_field(f"{prefix}target", f"has an unknown value {target}; use "
                            f"{_one_of([pb.WeightTarget.Name(v) for v in TARGET_ENUM.values()])}",
                            sep=" ", rpc=rpc)
    if in_flight not in MODES:
        raise invalid_field(f"{prefix}in_flight", f"has an unknown value {in_flight}; use "
                            f"{_one_of([pb.InFlightMode.Name(v) for v in MODES if v != pb.IN_FLIGHT_UNSPECIFIED])}",
                            sep=" ", rpc=rpc)
    return TARGET_NAMES[target], MODES[in_flight]


def _one_of(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def header_from_proto(h: pb.PushHeader, rpc: str) -> Header:
    target, mode = target_and_mode(h.target, h.in_flight, f"{rpc}: header")
    if rpc == "UpdateDraft":
        if h.target not in (pb.TARGET_UNSPECIFIED, pb.TARGET_DRAFTER):
            raise invalid_field("header.target", "must be TARGET_DRAFTER (use PushWeights for the policy)", sep=" ",
                                rpc="UpdateDraft")
        target = "drafter"
    elif target not in ("policy", "adapter"):
        raise invalid_field("header.target", "must be TARGET_POLICY or TARGET_ADAPTER (use UpdateDraft for the "
                            "drafter)", sep=" ", rpc="PushWeights")
    if target != "adapter" and (h.adapter or h.adapter_config):
        raise invalid_field("header.adapter", "is for TARGET_ADAPTER pushes only", sep=" ", rpc=rpc)
    return Header(h.version, target, h.total_bytes, h.sha256, mode, h.partial, h.adapter, h.adapter_config,
                  h.base_version)


async def push_items(messages, rpc: str):
    """The PushRequests after the header -> what WeightService.push takes: a Chunk per TensorChunk message, a list of
    Chunks per TensorBatch (its entries in order, each checked by the push as a chunk of its own), then the Trailer
    if one came (it must be the last message)."""
    def chunk(c: pb.TensorChunk) -> Chunk:
        return Chunk(c.name, c.dtype, tuple(c.shape), c.offset, c.data, c.indices)

    trailer = None
    async for m in messages:
        kind = m.WhichOneof("item")
        if trailer is not None:
            raise invalid(f"{rpc}: the trailer must be the last message of the stream")
        if kind == "chunk":
            yield chunk(m.chunk)
        elif kind == "batch":
            if not m.batch.chunks:
                raise invalid(f"{rpc}: a PushRequest.batch with no chunks; send at least one TensorChunk in it")
            yield [chunk(c) for c in m.batch.chunks]
        elif kind == "trailer":
            trailer = Trailer(m.trailer.sha256)
        else:
            raise invalid(f"{rpc}: only the first message may carry a header")
    if trailer is not None:
        yield trailer


def group_to_proto(g) -> pb.WeightTransferGroup:
    """weights.transfer.Group -> WeightTransferGroup."""
    return pb.WeightTransferGroup(
        backend=g.backend, world_size=g.world_size, trainer_ranks=g.trainer_ranks, joined=g.joined,
        engines=[pb.EngineRanks(engine=e.id, rank_offset=off, ranks=n) for e, off, n in g.engines],
        buffer_bytes=g.buffer_bytes, group_id=g.group_id, timeout_s=g.timeout_s)


def metas_from_proto(tensors) -> list[Meta]:
    return [Meta(t.name, t.dtype, tuple(t.shape), t.src_rank) for t in tensors]


def push_result_to_proto(o: PushOutcome) -> pb.PushResult:
    return pb.PushResult(version=o.version, target=TARGET_ENUM[o.target], num_tensors=o.num_tensors,
                         num_bytes=o.num_bytes, partial=o.partial, base_version=o.base_version,
                         fingerprint=o.fingerprint,
                         timings=pb.PushTimings(receive_s=o.receive_s, validate_s=o.validate_s, apply_s=o.apply_s,
                                                pause_s=o.pause_s, total_s=o.total_s,
                                                prepare_s=o.prepare_s))
