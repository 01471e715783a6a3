"""Typed results the client hands back: numpy arrays, not lists of protos."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollout_client.api import pb
from rollout_client.wire import FINISH_REASONS, TARGET_NAMES


@dataclass(frozen=True)
class Sample:
    """One generated sample."""

    prompt_index: int
    sample_index: int
    token_ids: np.ndarray             # int64 [gen_len]
    logprobs: np.ndarray              # float32 [gen_len], processed distribution actually sampled from
    finish_reason: str                # "stop" | "length" | "abort"
    stop_string: str
    policy_version: int
    version_spans: list[tuple[int, int]]   # (policy_version, first_token_index)
    draft_version: int
    num_drafted: int
    num_accepted: int
    text: str
    num_prompt_tokens: int
    prompt_token_ids: np.ndarray | None = field(default=None)   # set on the first sample of a text prompt
    top_token_ids: np.ndarray | None = field(default=None)   # int64 [gen_len, k] with top_logprobs=k, most likely first
    top_logprobs: np.ndarray | None = field(default=None)    # float32 [gen_len, k], same distribution as logprobs
    delta: bool = False              # stream_tokens: only the tokens new since this sample's previous message
    delta_start: int = 0             # in a delta: the index of token_ids[0] in the whole sample
    num_cached_tokens: int = 0       # prompt tokens the engine found in its prefix cache (session_id: earlier turns)
    routed_experts: "RoutedExperts | None" = field(default=None)   # return_routed_experts: an MoE policy's routes
    policy: str = ""                 # the LoRA adapter that generated it ("" for the base policy)
    message: "AssistantMessage | None" = field(default=None)   # a chat prompt's sample, read by the server's parsers

    @classmethod
    def from_proto(cls, m: pb.Sample) -> "Sample":
        n = len(m.token_ids)
        k = len(m.top_token_ids) // n if n else 0
        return cls(
            prompt_index=m.prompt_index, sample_index=m.sample_index,
            token_ids=np.asarray(m.token_ids, dtype=np.int64), logprobs=np.asarray(m.logprobs, dtype=np.float32),
            finish_reason=FINISH_REASONS.get(m.finish_reason, "unspecified"), stop_string=m.stop_string,
            policy_version=m.policy_version,
            version_spans=[(s.policy_version, s.first_token) for s in m.version_spans],
            draft_version=m.draft_version, num_drafted=m.num_drafted, num_accepted=m.num_accepted, text=m.text,
            num_prompt_tokens=m.num_prompt_tokens,
            prompt_token_ids=np.asarray(m.prompt_token_ids, dtype=np.int64) if m.prompt_token_ids else None,
            top_token_ids=np.asarray(m.top_token_ids, dtype=np.int64).reshape(n, k) if k else None,
            top_logprobs=np.asarray(m.top_logprobs, dtype=np.float32).reshape(n, k) if k else None,
            delta=m.delta, delta_start=m.delta_start, num_cached_tokens=m.num_cached_tokens,
            routed_experts=RoutedExperts.from_proto(m.routed_experts) if m.HasField("routed_experts") else None,
            policy=m.policy,
            message=AssistantMessage.from_proto(m.message) if m.HasField("message") else None,
        )


@dataclass(frozen=True)
class ToolCall:
    """A tool call the server's tool-call parser read from a sample."""
    id: str
    name: str
    arguments: str                   # JSON text


@dataclass(frozen=True)
class AssistantMessage:
    """The assistant message read from a chat sample (or by Parse): content, reasoning, tool calls."""
    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]

    @classmethod
    def from_proto(cls, m: pb.AssistantMessage) -> "AssistantMessage":
        return cls(m.content if m.HasField("content") else None, m.reasoning if m.HasField("reasoning") else None,
                   tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls))

    def openai(self) -> dict:
        """As an OpenAI chat message (the next turn's history)."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                               "arguments": c.arguments}}
                                 for c in self.tool_calls]
        return msg


@dataclass(frozen=True)
class RoutedExperts:
    """The experts a mixture-of-experts policy routed tokens to (GenerateRequest.return_routed_experts): row t is
    the token at position t of prompt + generated tokens, `ids[t, layer]` its top-k experts at that layer. A whole
    sample has num_prompt_tokens + len(token_ids) - 1 rows (its last token was never an input)."""

    ids: np.ndarray                       # uint8 or uint16 [rows, layers, top_k]
    first_row: int                        # index of ids[0] in the whole sample (> 0 only in a delta)
    version_spans: list[tuple[int, int]]  # (policy_version, first row it routed)

    @classmethod
    def from_proto(cls, m: pb.RoutedExperts) -> "RoutedExperts":
        dtype = np.dtype("<u1" if m.dtype == "uint8" else "<u2")
        return cls(ids=np.frombuffer(m.ids, dtype=dtype).reshape(tuple(m.shape)), first_row=m.first_row,
                   version_spans=[(s.policy_version, s.first_token) for s in m.version_spans])

    def to_proto(self) -> pb.RoutedExperts:
        return pb.RoutedExperts(ids=np.ascontiguousarray(self.ids).astype(self.ids.dtype.newbyteorder("<")).tobytes(),
                                shape=list(self.ids.shape), dtype="uint8" if self.ids.dtype.itemsize == 1 else "uint16",
                                first_row=self.first_row,
                                version_spans=[pb.VersionSpan(policy_version=int(v), first_token=int(t))
                                               for v, t in self.version_spans])


def build_request(prompts, *, n: int = 1, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, max_tokens: int | None = None, stop=(), seed: int | None = None,
                  ignore_eos: bool = False, stop_token_ids=(), request_id: str = "",
                  min_policy_version: int = 0, return_text: bool = False,
                  chat: bool = False, top_logprobs: int = 0, stream_tokens: bool = False,
                  return_partial: bool = False, partials=None, session_id: str = "",
                  return_routed_experts: bool = False, policy: str = "",
                  policy_version: int = 0) -> pb.GenerateRequest:
    """prompts: a list whose items are token-id sequences (list/array of ints), strings, or pb.Prompt messages (a chat
    prompt: rollout_client.Episode.prompt()). top_logprobs: k most
    likely tokens per position (Sample.top_token_ids / top_logprobs). stream_tokens: also yield each sample's new
    tokens as they are produced (Sample.delta), before the whole sample. return_partial: a sample aborted by a
    weight push or pause in abort mode comes back as it stands (finish_reason "abort") instead of the request
    failing with ABORTED. partials: one per prompt, None or a partial Sample (an aborted one) to continue: each
    sample of that prompt comes back as one sample, the partial's tokens first; max_tokens bounds both parts.
    session_id: a conversation's key; its requests go to the engine that holds its earlier turns in cache.
    return_routed_experts: every sample carries Sample.routed_experts (a mixture-of-experts policy's routes, for
    routing replay in the trainer); a partial sample's routes are sent back with it and joined. policy: a LoRA
    adapter's name to sample ("" for the base policy), policy_version: one of its loaded versions (0: the latest)."""
    if partials is not None and len(partials) != len(prompts):
        raise ValueError(f"partials: one per prompt (None for a fresh one); got {len(partials)} for "
                         f"{len(prompts)} prompts")
    items = []
    for i, p in enumerate(prompts):
        if isinstance(p, pb.Prompt):
            items.append(p)
        elif isinstance(p, str):
            items.append(pb.Prompt(text=p, apply_chat_template=chat))
        else:
            items.append(pb.Prompt(token_ids=[int(t) for t in p]))
        if partials is not None and partials[i] is not None:
            items[-1].partial.CopyFrom(partial_to_proto(partials[i]))
    sp = pb.SamplingParams(stop=list(stop), ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids))
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                        ("max_tokens", max_tokens), ("seed", seed)):
        if value is not None:
            setattr(sp, name, value)
    return pb.GenerateRequest(request_id=request_id, prompts=items, n=n, sampling=sp,
                              min_policy_version=min_policy_version, return_text=return_text,
                              top_logprobs=top_logprobs, stream_tokens=stream_tokens, return_partial=return_partial,
                              session_id=session_id, return_routed_experts=return_routed_experts, policy=policy,
                              policy_version=policy_version)


def partial_to_proto(s) -> pb.PartialSample:
    """A Sample (or anything with its token_ids, logprobs, version_spans and optional top_* fields) -> the
    PartialSample that continues it."""
    top_ids, top_lps = getattr(s, "top_token_ids", None), getattr(s, "top_logprobs", None)
    return pb.PartialSample(
        token_ids=[int(t) for t in s.token_ids], logprobs=[float(x) for x in s.logprobs],
        version_spans=[pb.VersionSpan(policy_version=int(v), first_token=int(t)) for v, t in s.version_spans],
        top_token_ids=[] if top_ids is None else np.asarray(top_ids, dtype=np.int64).ravel().tolist(),
        top_logprobs=[] if top_lps is None else np.asarray(top_lps, dtype=np.float32).ravel().tolist(),
        routed_experts=s.routed_experts.to_proto() if getattr(s, "routed_experts", None) is not None else None,
        policy=getattr(s, "policy", ""))


@dataclass(frozen=True)
class PushResult:
    """A committed weight or drafter push."""

    version: int
    target: str                  # "policy" | "drafter"
    num_tensors: int
    num_bytes: int
    partial: bool
    receive_s: float
    validate_s: float
    apply_s: float
    pause_s: float
    total_s: float
    prepare_s: float             # loading beside the served weights while generating (before the pause)
    base_version: int = 0        # a delta's base (0: a full push)
    fingerprint: str = ""        # the target's committed weights (rollout_client.delta.fingerprint)

    @classmethod
    def from_proto(cls, m: pb.PushResult) -> "PushResult":
        t = m.timings
        return cls(m.version, TARGET_NAMES.get(m.target, "policy"), m.num_tensors, m.num_bytes,
                   m.partial, t.receive_s, t.validate_s, t.apply_s, t.pause_s, t.total_s, t.prepare_s,
                   m.base_version, m.fingerprint)
