"""GenerateRequest (proto) -> checked internal sequences. Every rejection names the field at fault."""
from __future__ import annotations

import hashlib
import math
import re
import struct
import uuid
from dataclasses import dataclass

import grpc
import msgspec

from rollout_service.api import pb
from rollout_service.engine.types import Routes, SeqRequest
from rollout_service.errors import Name, about_field, invalid_field
from rollout_service.model_info import ModelInfo, MoeShape
from rollout_service.pool.partial import Partial

DEFAULT_MAX_TOKENS = 128
MAX_TEMPERATURE = 2.0
# vLLM raises positive temperatures below 0.01 to 0.01 (sampling_params._MAX_TEMP); they are refused here.
# The floor is 0.01 as a float32 (the wire type), so a client's 0.01 passes.
MIN_TEMPERATURE = struct.unpack("f", struct.pack("f", 0.01))[0]
_SEED_MOD = 2**63 - 1
MAX_TOKENS = Name("sampling.max_tokens", "max_tokens")    # as a hint's text names it ("lower max_tokens")
MAX_SESSION_ID = 256


@dataclass
class Limits:
    max_prompts_per_request: int
    max_samples_per_prompt: int
    max_new_tokens: int = 0           # 0: up to the context length
    max_top_logprobs: int = 20        # GenerateRequest.top_logprobs at most
    routed_experts: bool = False      # the engines capture routed experts (an MoE policy, engine.routed_experts)
    speculation: str = "none"         # the engines' speculation method: constrained tool choices are refused under one


@dataclass
class CheckedRequest:
    request_id: str               # "" when the client gave none (no deduplication)
    fingerprint: bytes
    groups: list[list[SeqRequest]]   # groups[prompt_index][sample_index]
    prompt_token_ids: list[list[int]]
    text_prompts: set[int]        # prompt indices that arrived as text
    partials: list[Partial | None]   # per prompt: the partial sample it continues (Prompt.partial)
    return_partial: bool = False     # aborted samples come back partial (GenerateRequest.return_partial)
    session_id: str = ""          # routes the request to its session's engine (pool/sessions.py)
    policy: str = ""              # a LoRA adapter's name (GenerateRequest.policy); "" for the base policy
    policy_version: int = 0       # GenerateRequest.policy_version (0: the latest)
    chats: list | None = None     # per prompt: its checked chat.request.ChatPrompt (Prompt.chat), else None


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """Seed of sample s of prompt p: distinct per sample, reproducible from the request's seed."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_MOD


def session_id_problem(sid: str) -> str | None:
    """What is wrong with a session key (GenerateRequest.session_id; the dialects' session headers), or None."""
    if len(sid) > MAX_SESSION_ID:
        return f"at most {MAX_SESSION_ID} characters, got {len(sid)}"
    bad = next((i for i, c in enumerate(sid) if not 32 <= ord(c) < 127), None)
    if bad is not None:
        return f"must be printable ASCII (space to '~'); character {bad} is U+{ord(sid[bad]):04X}"
    return None


def check_generate(req: pb.GenerateRequest, model: ModelInfo, limits: Limits, parsing=None,
                   fill_context: bool = False) -> CheckedRequest:
    """parsing: the server's chat parsers (chat.parse.Parsing) for chat prompts; blocking with text or chat prompts
    (the tokenizer and the chat template): call it in the tokenizer thread then. fill_context: an unset
    sampling.max_tokens means up to the context length (the server's max_new_tokens at most), per prompt, as vLLM's
    chat endpoint reads a missing max_tokens (the vLLM dialect's chat)."""
    rid = req.request_id
    if len(rid) > 128 or not all(32 < ord(c) < 127 for c in rid):
        raise invalid_field("request_id", "at most 128 printable ASCII characters without spaces")
    sid = req.session_id
    problem = session_id_problem(sid)
    if problem:
        raise invalid_field("session_id", problem)
    if not req.prompts:
        raise invalid_field("prompts", "at least one prompt is required")
    if len(req.prompts) > limits.max_prompts_per_request:
        raise invalid_field("prompts", f"{len(req.prompts)} prompts exceed max_prompts_per_request="
                                       f"{limits.max_prompts_per_request}; split the batch")
    n = req.n or 1
    if n < 1:
        raise invalid_field("n", f"must be >= 1, got {req.n}")
    if n > limits.max_samples_per_prompt:
        raise invalid_field("n", f"{n} exceeds max_samples_per_prompt={limits.max_samples_per_prompt}")

    sp = req.sampling
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    top_k = sp.top_k if sp.HasField("top_k") else 0
    fill_context = fill_context and not sp.HasField("max_tokens")
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    # vLLM's ranges (vllm/sampling_params.py, checked before admission so the engine never refuses them)
    if not 0 <= temperature <= MAX_TEMPERATURE:          # also NaN and +-inf
        raise invalid_field("sampling.temperature",
                            f"must be a finite value in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise invalid_field("sampling.temperature", f"{temperature:g} is below vLLM's floor of 0.01 (vLLM would "
                            "silently sample at 0.01 instead); use 0 for greedy decoding or a value in [0.01, 2]")
    if not 0 < top_p <= 1:
        raise invalid_field("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise invalid_field("sampling.top_k", f"must be -1 or 0 (disabled) or >= 1, got {top_k}")
    if max_tokens < 1:
        raise invalid_field("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    if limits.max_new_tokens and max_tokens > limits.max_new_tokens:
        raise invalid_field("sampling.max_tokens", f"{max_tokens} exceeds the server's max_new_tokens="
                            f"{limits.max_new_tokens}; lower ", MAX_TOKENS)
    if any(s == "" for s in sp.stop):
        raise invalid_field("sampling.stop", "stop strings must be non-empty")
    for t in sp.stop_token_ids:
        if not 0 <= t < model.vocab_size:
            raise invalid_field("sampling.stop_token_ids", f"{t} is outside the vocabulary [0, {model.vocab_size})")
    if req.policy:
        problem = name_problem(req.policy)
        if problem:
            raise invalid_field("policy", problem)
    if req.policy_version < 0:
        raise invalid_field("policy_version", f"must be >= 0 (0: the latest), got {req.policy_version}")
    for i, p in enumerate(req.prompts):
        if p.HasField("partial") and p.partial.policy != req.policy:
            raise invalid_field(f"prompts[{i}].partial.policy",
                                f"the partial sample was generated by {p.partial.policy or 'the base policy'!r} but "
                                f"the request samples {req.policy or 'the base policy'!r}; a partial sample "
                                "continues on the policy it started on")
    if req.min_policy_version < 0:
        raise invalid_field("min_policy_version", f"must be >= 0, got {req.min_policy_version}")
    if not 0 <= req.top_logprobs <= limits.max_top_logprobs:
        raise invalid_field("top_logprobs", f"must be in [0, {limits.max_top_logprobs}] (the server's "
                            f"max_top_logprobs), got {req.top_logprobs}")
    routes = req.return_routed_experts
    if routes and model.moe is None:
        raise invalid_field("return_routed_experts", f"the served policy {model.path} is dense (not a mixture of "
                            "experts): it routes no tokens; leave it false")
    if routes and not limits.routed_experts:
        raise about_field(grpc.StatusCode.FAILED_PRECONDITION, "return_routed_experts",
                          "this server does not capture routed experts (started with engine.routed_experts = off); "
                          "restart it with --routed-experts auto")

    prompts: list[list[int]] = []
    partials: list[Partial | None] = []
    text_prompts: set[int] = set()
    chats: list = [None] * len(req.prompts)
    budgets: list[int] = []                # per prompt, with fill_context
    schemas: list[str] = [""] * len(req.prompts)
    for i, p in enumerate(req.prompts):
        if sum((bool(p.token_ids), bool(p.text), p.HasField("chat"))) > 1:
            raise invalid_field(f"prompts[{i}]", "set exactly one of token_ids, text or chat")
        if p.HasField("chat"):
            chats[i], ids, schemas[i] = _chat(p.chat, f"prompts[{i}].chat.", model, parsing, limits)
            text_prompts.add(i)
        elif p.text:
            ids = model.encode(p.text, chat=p.apply_chat_template)
            text_prompts.add(i)
        else:
            ids = list(p.token_ids)
        if not ids:
            raise invalid_field(f"prompts[{i}]", "empty prompt (no token_ids and no text)")
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise invalid_field(f"prompts[{i}].token_ids", f"{bad} is outside the vocabulary [0, {model.vocab_size})")
        if fill_context:
            room = model.max_model_len - len(ids)
            max_tokens = max(1, min(room, limits.max_new_tokens) if limits.max_new_tokens else room)
            budgets.append(max_tokens)
        if len(ids) + max_tokens > model.max_model_len:
            raise invalid_field(f"prompts[{i}]", f"{len(ids)} prompt tokens + ", Name("sampling.max_tokens"),
                                    f"={max_tokens} exceed the context length {model.max_model_len}; shorten "
                                    "the prompt or lower ", MAX_TOKENS)
        prompts.append(ids)
        partials.append(_partial(f"prompts[{i}].partial", p.partial, req.top_logprobs, max_tokens, model.vocab_size)
                        if p.HasField("partial") else None)
        if partials[-1] is not None and routes and p.partial.HasField("routed_experts"):
            partials[-1] = msgspec.structs.replace(partials[-1], routed_experts=_partial_routes(
                f"prompts[{i}].partial.routed_experts", p.partial.routed_experts, model.moe,
                len(ids) + len(partials[-1]) - 1))

    base = rid or uuid.uuid4().hex
    seed = sp.seed if sp.HasField("seed") else None
    groups = [
        [SeqRequest(seq_id=f"{base}-{uuid.uuid4().hex[:8]}-{pi}-{si}",
                    prompt_token_ids=ids + partials[pi].token_ids if partials[pi] else ids,
                    temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                    max_tokens=(budgets[pi] if budgets else max_tokens) - (len(partials[pi]) if partials[pi] else 0),
                    stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
                    seed=None if seed is None else sample_seed(seed, pi, si), ignore_eos=sp.ignore_eos,
                    detokenize=bool(sp.stop) or req.return_text, top_logprobs=req.top_logprobs,
                    stream=req.stream_tokens, return_routed_experts=routes,
                    routes_from=partials[pi].routed_experts.end if partials[pi] and partials[pi].routed_experts
                    else 0, structured_outputs=schemas[pi])
         for si in range(n)]
        for pi, ids in enumerate(prompts)
    ]
    fingerprint = hashlib.sha256(req.SerializeToString(deterministic=True)).digest()
    return CheckedRequest(rid, fingerprint, groups, prompts, text_prompts, partials, req.return_partial, sid,
                          req.policy, req.policy_version, chats if any(chats) else None)


def _chat(chat: pb.ChatPrompt, where: str, model: ModelInfo, parsing, limits: Limits):
    """A chat prompt -> (checked ChatPrompt, its token ids, what constrains its sampling as vLLM constrains it for its
    tool choice (Parsing.constraint), or "")."""
    from rollout_service.chat.parse import Parsing
    from rollout_service.chat.render import render
    from rollout_service.chat.request import from_proto

    parsing = parsing or Parsing(model.tokenizer)
    prompt = from_proto(chat, where)
    parsing.check(prompt, where)
    ids, _ = render(model.tokenizer, prompt, where)
    constraint = parsing.constraint(prompt)
    if constraint and limits.speculation != "none":
        # measured: vLLM 0.32's CPU engine under draft-model speculation broke the structural tag (dropped the newlines
        # it requires: tests/integration/test_speculation.py)
        raise invalid_field(where + "tool_choice", f"{prompt.tool_choice!r:.80} constrains sampling (vLLM's structured "
                            f"outputs), which this server does not serve under speculation ({limits.speculation}): "
                            "its grammar is not kept with drafted tokens on this vLLM build; use tool_choice \"auto\" "
                            "(the policy's own calls) or a server without speculation")
    return prompt, ids, constraint


def _partial(where: str, p: pb.PartialSample, k: int, max_tokens: int, vocab_size: int) -> Partial:
    """Prompt.partial -> Partial, or INVALID_ARGUMENT naming the part at fault."""
    n = len(p.token_ids)
    bad = next((t for t in p.token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_field(f"{where}.token_ids", f"{bad} is outside the vocabulary [0, {vocab_size})")
    if n >= max_tokens:
        raise invalid_field(f"{where}.token_ids", f"{n} tokens already generated leave none of ",
                            Name("sampling.max_tokens"), f"={max_tokens} (it bounds the whole sample); raise ",
                            MAX_TOKENS)
    if len(p.logprobs) != n:
        raise invalid_field(f"{where}.logprobs", f"{len(p.logprobs)} log-probs for {n} tokens; give one per token")
    if not all(lp <= 0 for lp in p.logprobs):               # also NaN
        raise invalid_field(f"{where}.logprobs", "log-probs must be <= 0 (and not NaN)")
    spans = [(s.policy_version, s.first_token) for s in p.version_spans]
    if n and not spans:
        raise invalid_field(f"{where}.version_spans", "the policy versions that generated the tokens are required "
                            "(the partial sample's version_spans)")
    starts = [t for _, t in spans]
    if spans and (starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= max(n, 1)
                  or any(v < 0 for v, _ in spans)):
        raise invalid_field(f"{where}.version_spans", f"must start at token 0 with first_token strictly increasing "
                            f"and below {n} (the partial's length), versions >= 0; got {spans}")
    for name, rows in (("top_token_ids", p.top_token_ids), ("top_logprobs", p.top_logprobs)):
        if len(rows) != n * k:
            raise invalid_field(f"{where}.{name}", f"{len(rows)} values; the request's top_logprobs={k} needs "
                                f"{n} x {k} = {n * k} (the partial sample's own top-k rows)")
    bad = next((t for t in p.top_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_field(f"{where}.top_token_ids", f"{bad} is outside the vocabulary [0, {vocab_size})")
    ids, lps = list(p.top_token_ids), list(p.top_logprobs)
    return Partial(token_ids=list(p.token_ids), logprobs=list(p.logprobs), version_spans=spans,
                   top_token_ids=[ids[i * k:(i + 1) * k] for i in range(n)] if k else [],
                   top_logprobs=[lps[i * k:(i + 1) * k] for i in range(n)] if k else [])


def _partial_routes(where: str, r: pb.RoutedExperts, moe: MoeShape, rows: int) -> Routes:
    """PartialSample.routed_experts -> Routes of its `rows` rows, or INVALID_ARGUMENT naming the part at fault."""
    shape = (rows, moe.num_layers, moe.top_k)
    if tuple(r.shape) != shape:
        raise invalid_field(f"{where}.shape", f"must be {list(shape)} (prompt tokens + partial tokens - 1, the "
                            f"policy's layers, its top-k), got {list(r.shape)}")
    if r.dtype != moe.dtype:
        raise invalid_field(f"{where}.dtype", f"must be {moe.dtype!r} for {moe.num_experts} experts, got {r.dtype!r}")
    width = 1 if moe.dtype == "uint8" else 2
    if len(r.ids) != rows * moe.num_layers * moe.top_k * width or r.first_row != 0:
        raise invalid_field(f"{where}.ids", f"must hold {rows} x {moe.num_layers} x {moe.top_k} {moe.dtype} values "
                            f"from row 0 ({len(r.ids)} bytes from row {r.first_row} given): the sample's own routes")
    import numpy as np

    if rows and int(np.frombuffer(r.ids, dtype="<u1" if width == 1 else "<u2").max()) >= moe.num_experts:
        raise invalid_field(f"{where}.ids", f"expert ids must be below {moe.num_experts}")
    spans = [(s.policy_version, s.first_token) for s in r.version_spans]
    starts = [t for _, t in spans]
    if rows and (not spans or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= rows
                 or any(v < 0 for v, _ in spans)):
        raise invalid_field(f"{where}.version_spans", f"must start at row 0 with first_token strictly increasing "
                            f"and below {rows}, versions >= 0; got {spans}")
    return Routes(first_row=0, rows=rows, layers=moe.num_layers, top_k=moe.top_k, dtype=moe.dtype, data=r.ids,
                  version_spans=spans)


ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def name_problem(name: str) -> str | None:
    """What is wrong with an adapter name, or None."""
    if not ADAPTER_NAME.fullmatch(name):
        return (f"{name[:80]!r} is not an adapter name: 1-64 characters, letters, digits, '.', '_' or '-'"
                if name else "required: the adapter's name (the policy requests name)")
    return None


def number_problem(value: float, lo_open: float, hi: float, unit: str = "") -> str | None:
    """A float that must be finite and in (lo_open, hi] (NaN and the infinities fail too), or None."""
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if not lo_open < value <= hi:
        return f"must be in ({lo_open:g}, {hi:g}]{unit}, got {value:g}"
    return None
