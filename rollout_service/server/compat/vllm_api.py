"""vLLM's HTTP dialect (OpenAI completions and chat, tokens in/out generate, RL control endpoints), as a
thin translator onto the pool: what TRL's AsyncGRPO, prime-rl, SkyRL, verifiers and the `openai` package call.

Every answer carries the policy version(s) and drafter statistics: per choice in `rollout` (and vLLM's own
`weight_versions` spans), per response in `x-rollout-*` headers. A stream sends a chunk per engine step and choice
(the pool's token deltas; a slow reader gets the steps it missed in one chunk), then the choice's last chunk with
its finish reason.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import grpc
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from rollout_service.api import pb
from rollout_service.engine.types import SeqResult
from rollout_service.errors import ServiceError
from rollout_service.pool.requests import IndexedResult, split
from rollout_service.server.compat.dialect import FastJSONResponse, sse_event
from rollout_service.server.compat.routes import routes_npy_base64
from rollout_service.server.compat.gateway import (
    MIN_LOGPROB,
    DialectError,
    StreamText,
    Fields,
    Gateway,
    answers_errors,
    from_service_error,
    gateway,
    in_flight_mode,
    json_body,
    rollout_fields,
    rollout_headers,
    sampling_params,
    token_prompt,
    until_disconnect,
)

router = APIRouter()
# the contract's names as each endpoint spells them (gateway.spell)
SPELLING = {"sampling.max_tokens": "max_tokens", "sampling.": "", "prompts": "prompt", "top_logprobs": "logprobs"}
GENERATE_SPELLING = {"sampling.": "sampling_params.", "prompts[0]": "token_ids", "n": "sampling_params.n",
                     "min_policy_version": "sampling_params.min_policy_version",
                     "top_logprobs": "sampling_params.logprobs"}
LOAD_SPELLING = {"LoadWeights": "update_weights", "path": "weight_dir"}       # /update_weights {"weight_dir"}


@dataclass
class Options:
    """How to write the answer (the request's non-sampling fields)."""
    kind: str                      # "completion" | "chat" | "generate"
    n: int
    logprobs: bool
    token_ids: bool                # return_token_ids
    tokens_as_ids: bool            # return_tokens_as_token_ids
    stream: bool
    usage_in_stream: bool
    text: bool = True
    fill_context: bool = False     # an unset max_tokens fills the context (vLLM's chat)


# ---- parsing ----------------------------------------------------------------------------------------
def _common(f: Fields, kind: str, max_tokens_key: str = "max_tokens") -> tuple[pb.GenerateRequest, Options]:
    f.unsupported("echo", False, "echoing the prompt is not supported; the prompt's ids come with "
                                 "return_token_ids")
    f.unsupported("best_of", 1, "best_of is not supported; ask for n samples and rank them yourself")
    f.unsupported("use_beam_search", False, "beam search is not supported (it does not sample the policy)")
    f.unsupported("min_tokens", 0, "min_tokens is not supported (it changes the sampled distribution)")
    f.unsupported("prompt_logprobs", None, "prompt log-probs are not served; compute them in the trainer")
    # as vLLM: an aborted sample answers the tokens it has, with finish_reason "abort"
    req = pb.GenerateRequest(sampling=sampling_params(f, max_tokens_key), return_partial=True)
    n = f.int("n", 1)
    req.n = max(min(n, 2**31 - 1), -(2**31))
    rid = f.get("request_id", "")
    if not isinstance(rid, str):
        raise DialectError(400, "request_id: must be a string", "request_id")
    req.request_id = rid
    mpv = f.int("min_policy_version", 0)
    if mpv < 0:
        raise DialectError(400, f"min_policy_version: must be >= 0, got {mpv}", "min_policy_version")
    req.min_policy_version = min(mpv, 2**63 - 1)
    stream_options = f.get("stream_options", {}) or {}
    if kind == "chat":                   # logprobs: true, top_logprobs: N
        lp = f.bool("logprobs")
        top = f.int("top_logprobs", 0)
        if top and not lp:
            raise DialectError(400, "top_logprobs: needs \"logprobs\": true", "top_logprobs")
    else:                                # logprobs: N (the sampled token's log-prob and the N most likely)
        top = f.int("logprobs")
        lp = top is not None
    req.top_logprobs = max(min(top or 0, 2**31 - 1), -(2**31))       # validation names the range
    opts = Options(kind, n, lp, f.bool("return_token_ids"), f.bool("return_tokens_as_token_ids"),
                   f.bool("stream"), bool(isinstance(stream_options, dict) and stream_options.get("include_usage")))
    return req, opts


def parse_completion(body: dict) -> tuple[pb.GenerateRequest, Options]:
    f = Fields(body)
    req, opts = _common(f, "completion")
    if "max_tokens" not in body or body["max_tokens"] is None:
        req.sampling.max_tokens = 16                  # vLLM's and OpenAI's default for completions
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [pb.Prompt(text=prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [token_prompt(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [pb.Prompt(text=p) if isinstance(p, str) else token_prompt(p, f"prompt[{i}]")
                   for i, p in enumerate(prompt)]
    else:
        raise DialectError(400, "prompt: must be a string, a list of token ids, or a list of either", "prompt")
    req.prompts.extend(prompts)
    req.return_text = False                           # decoded here, off the engine's event loop
    return req, opts


def parse_generate(body: dict) -> tuple[pb.GenerateRequest, Options]:
    """/inference/v1/generate: token ids in, `sampling_params` as vLLM's SamplingParams."""
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise DialectError(400, "sampling_params: must be an object (vLLM's SamplingParams)", "sampling_params")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise DialectError(400, "token_ids: must be a non-empty list of token ids", "token_ids")
    outer = Fields(body)
    req, opts = _common(Fields(sp, "sampling_params."), "generate")
    req.request_id = "" if body.get("request_id") is None else str(body["request_id"])
    req.prompts.append(token_prompt(ids, "token_ids"))
    opts.token_ids, opts.stream = outer.bool("return_token_ids"), outer.bool("stream")
    opts.text = body.get("output_mode", "tokens") == "text"
    return req, opts


# ---- answers ----------------------------------------------------------------------------------------
def _stop_reason(r, stop_ids: set[int]):
    if r.finish_reason != "stop":
        return None
    if r.stop_string:
        return r.stop_string
    return r.token_ids[-1] if r.token_ids and r.token_ids[-1] in stop_ids else None


def _weight_versions(r) -> list[dict]:
    spans = list(r.version_spans) or [(r.policy_version, 0)]
    ends = [t for _, t in spans[1:]] + [len(r.token_ids)]
    return [{"version": str(v), "start": t, "end": e} for (v, t), e in zip(spans, ends)]


class Writer:
    """Finished samples -> the dialect's choices. Decoding runs in the tokenizer thread (never the loop)."""

    def __init__(self, gw: Gateway, opts: Options, checked, req: pb.GenerateRequest):
        self.gw, self.opts, self.checked = gw, opts, checked
        self.stop_ids = set(req.sampling.stop_token_ids)
        self.rid = f"{'chatcmpl' if opts.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = req.policy or gw.model.path          # an adapter's answers name the adapter, as vLLM's do
        self.chats = checked.chats                        # a chat prompt's checked ChatPrompt (tools, tool_choice)
        self.streams: dict = {}                           # (prompt, sample) -> chat.parse.Stream

    def chat_of(self, item):
        return self.chats[item.prompt_index] if self.chats else None

    def decode(self, items, texts) -> list[tuple[str, dict[int, str]]]:
        """(text, token id -> its string) per item; texts: the items' texts where already known (streams). A chat
        prompt's whole sample: its assistant message as the server's parsers read it instead of the text."""
        tok = self.gw.model.tokenizer
        out = []
        for item, known in zip(items, texts):
            r = item.result
            chat = self.chat_of(item)
            if chat is not None and known is None:
                text = self.gw.service.parsing.parse(chat, r.token_ids,
                                                     self.checked.prompt_token_ids[item.prompt_index])
            else:
                text = known if known is not None else self.gw.decode(r.token_ids) if self.opts.text else ""
            names: dict[int, str] = {}
            if self.opts.logprobs and not self.opts.tokens_as_ids:
                ids = sorted(set(r.token_ids).union(*map(set, r.top_token_ids)))
                names = dict(zip(ids, tok.batch_decode([[t] for t in ids])))
            out.append((text, names))
        return out

    def stream_delta(self, item, finished: bool) -> dict | None:
        """A chat prompt's streamed tokens -> the delta vLLM streams for them (content, reasoning, tool-call pieces;
        None while a tag is incomplete). Blocking: the tokenizer thread."""
        key = (item.prompt_index, item.sample_index)
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = self.gw.service.parsing.stream(
                self.chat_of(item), self.checked.prompt_token_ids[item.prompt_index])
        return stream.step(list(item.result.token_ids), finished)

    def finish_reason(self, item, message) -> str | None:
        """vLLM's: "tool_calls" where tool_choice auto called a tool, or "required" stopped by itself."""
        r, chat = item.result, self.chat_of(item)
        if chat is None or r.finish_reason is None or chat.tools is None:
            return r.finish_reason
        called = bool(message.get("tool_calls")) if isinstance(message, dict) else bool(
            getattr(message, "tool_calls", None))
        if (chat.tool_choice in ("auto", None) and called) or (chat.tool_choice == "required" and
                                                               r.finish_reason == "stop"):
            return "tool_calls"
        return r.finish_reason

    async def choices(self, items, texts=None) -> list[dict]:
        decoded = await self.gw.in_tokenizer_thread(self.decode, items, texts or [None] * len(items))
        return [self.choice(item, text, names) for item, (text, names) in zip(items, decoded)]

    def index(self, item) -> int:
        return item.prompt_index * self.opts.n + item.sample_index

    def choice(self, item, text: str, names: dict[int, str]) -> dict:
        r, o = item.result, self.opts

        def name(t: int) -> str:
            return names[t] if t in names else f"token_id:{t}"

        tops = r.top_token_ids or [[] for _ in r.token_ids]
        top_lps = r.top_logprobs or [[] for _ in r.token_ids]
        c: dict = {"index": self.index(item), "finish_reason": r.finish_reason,
                   "stop_reason": _stop_reason(r, self.stop_ids)}
        if o.kind == "chat":
            def entry(t: int, lp: float) -> dict:
                return {"token": name(t), "logprob": max(lp, MIN_LOGPROB), "bytes": list(name(t).encode())}
            if isinstance(text, str):
                c["message"] = {"role": "assistant", "content": text}
            else:                                     # read by the tool and reasoning parsers (chat.parse.Message)
                c["message"] = text.openai()
                c["finish_reason"] = self.finish_reason(item, text)
            c["logprobs"] = {"content": [entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in zip(ts, ls)]}
                                         for t, lp, ts, ls in zip(r.token_ids, r.logprobs, tops, top_lps)]
                             } if o.logprobs else None
            c["token_ids"] = r.token_ids             # always (multi-turn clients send them back as the next prompt)
        elif o.kind == "generate":
            c["token_ids"] = r.token_ids
            if o.text:
                c["text"] = text
            # vLLM 0.32's entries (token_id, logprob, top_logprobs), plus the `token` string its chat-shaped entries
            # carry with --return-tokens-as-token-ids ("token_id:N"): renderers 0.1.12 (verifiers' train client)
            # checks that one
            c["logprobs"] = {"content": [{"token_id": t, "token": f"token_id:{t}", "logprob": lp,
                                          "top_logprobs": [{"token_id": a, "logprob": max(b, MIN_LOGPROB)}
                                                           for a, b in zip(ts, ls)]}
                                         for t, lp, ts, ls in zip(r.token_ids, r.logprobs, tops, top_lps)]
                             } if o.logprobs else None
        else:
            c["text"] = text
            if o.logprobs:
                strs = [name(t) for t in r.token_ids]
                offsets, at = [], 0
                for piece in strs:
                    offsets.append(at)
                    at += len(piece)
                # vLLM's shape: per position the N most likely tokens and the sampled one (its own entry last, or
                # where the top N has it: a dict keeps the first place of a key it updates)
                top_entries = []
                for s, lp, ts, ls in zip(strs, r.logprobs, tops, top_lps):
                    entry = dict(zip(map(name, ts), [b if b > MIN_LOGPROB else MIN_LOGPROB for b in ls]))
                    entry[s] = lp
                    top_entries.append(entry)
                c["logprobs"] = {"tokens": strs, "token_logprobs": r.logprobs, "top_logprobs": top_entries,
                                 "text_offset": offsets}
            else:
                c["logprobs"] = None
            if o.token_ids:
                c["token_ids"] = r.token_ids
                c["prompt_token_ids"] = self.checked.prompt_token_ids[item.prompt_index]
        c["weight_versions"] = _weight_versions(r)
        c["rollout"] = rollout_fields(r)
        if r.routed_experts is not None and r.finish_reason is not None:   # as vLLM: the whole sample's rows
            c["routed_experts"] = routes_npy_base64(r.routed_experts)
        return c

    def aborted_choice(self, p: int, s: int) -> dict:
        """A sample cut off by an abort (a weight push in abort mode, /pause?mode=abort, /abort_requests)."""
        c = {"index": p * self.opts.n + s, "finish_reason": "abort", "stop_reason": None, "token_ids": [],
             "logprobs": None}
        if self.opts.kind == "chat":
            c["message"] = {"role": "assistant", "content": ""}
        else:
            c["text"] = ""
        return c

    def usage(self, items) -> dict:
        # as vLLM: each prompt counted once, not once per sample (serving.py's num_prompt_tokens per prompt)
        prompt = sum(len(ids) for ids in self.checked.prompt_token_ids)
        completion = sum(len(i.result.token_ids) for i in items)
        hits: dict[int, int] = {}              # vLLM's prefix-cache hits (sessions): per prompt, its samples' least
        for i in items:
            n = i.result.num_cached_tokens
            hits[i.prompt_index] = min(hits.get(i.prompt_index, n), n)
        cached = sum(hits.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def envelope(self, choices: list[dict], items, chunk: bool = False) -> dict:
        obj = {"completion": "text_completion", "chat": "chat.completion", "generate": "generate"}[self.opts.kind]
        if chunk and self.opts.kind == "chat":
            obj = "chat.completion.chunk"
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if not chunk:
            body["usage"] = self.usage(items)
        if self.opts.kind == "chat" or (self.opts.kind == "generate" and self.opts.token_ids):
            body["prompt_token_ids"] = self.checked.prompt_token_ids[0]   # chat: always, as return_token_ids gives
        return body


async def _collect(gw: Gateway, req: pb.GenerateRequest, opts: Options, spelling) -> Response:
    req.return_routed_experts = gw.service.limits.routed_experts    # as vLLM's server capturing them: always
    async with gw.generate(req, spelling, fill_context=opts.fill_context) as (checked, samples):
        items, error = [], None
        try:
            async for item in samples:
                items.append(item)
        except ServiceError as e:
            if e.code != grpc.StatusCode.ABORTED:
                raise from_service_error(e, spelling) from None
            error = e
        w = Writer(gw, opts, checked, req)
        choices = await w.choices(items)
        if error is not None:                        # vLLM answers aborted samples with finish_reason "abort"
            done = {(i.prompt_index, i.sample_index) for i in items}
            choices += [w.aborted_choice(p, s) for p in range(len(checked.prompt_token_ids))
                        for s in range(opts.n) if (p, s) not in done]
        choices.sort(key=lambda c: c["index"])
        return FastJSONResponse(w.envelope(choices, items), headers=rollout_headers(items))


async def _stream(gw: Gateway, req: pb.GenerateRequest, opts: Options, spelling) -> Response:
    """Server-sent events: admission errors are HTTP statuses; then a chunk per engine step and choice with its new
    tokens (text, token_ids, logprobs; a reader that fell behind gets the steps it missed in one chunk), each
    choice's last chunk with the rest and its finish reason, the usage chunk (stream_options.include_usage) and
    [DONE]."""
    req.stream_tokens = True
    req.return_routed_experts = gw.service.limits.routed_experts
    cm = gw.generate(req, spelling, deltas=True, fill_context=opts.fill_context)
    checked, samples = await cm.__aenter__()          # a refusal here raises DialectError: a plain HTTP error
    w = Writer(gw, opts, checked, req)
    texts: dict[tuple[int, int], StreamText] = {}

    def text_of(key) -> StreamText:
        return texts.setdefault(key, StreamText(gw.decode))

    def delta_texts(parts: list[IndexedResult]) -> list[tuple[str, dict[int, str]]]:
        """In the tokenizer thread: each delta's text piece and its tokens' names."""
        pieces = [text_of((p.prompt_index, p.sample_index)).step(p.result.token_ids) if opts.text else ""
                  for p in parts]
        return w.decode(parts, pieces)

    def chat_deltas(parts: list[IndexedResult], finished: bool) -> list[tuple[dict | None, dict[int, str]]]:
        """In the tokenizer thread: each chat delta as the tool and reasoning parsers stream it, and its tokens'
        names."""
        named = w.decode(parts, [""] * len(parts))
        return [(w.stream_delta(p, finished), names) for p, (_, names) in zip(parts, named)]

    offsets: dict[tuple[int, int], int] = {}         # a choice's next logprobs.text_offset

    def chunk(choices: list[dict], first: bool, key) -> str:
        if opts.kind == "completion":   # as vLLM 0.32's completion_stream_generator (openai/completion/serving.py)
            for c in choices:
                lp = c["logprobs"]
                if lp is not None and lp["tokens"]:   # text_offset counts on from the choice's earlier chunks
                    lp["text_offset"] = [offsets.get(key, 0) + at for at in lp["text_offset"]]
                    offsets[key] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                if not first and "prompt_token_ids" in c:
                    c["prompt_token_ids"] = None       # only in the choice's first chunk
        if opts.kind == "chat":
            for c in choices:
                c["delta"] = c.pop("message")
                if not first:
                    c["delta"].pop("role")
        return sse_event(w.envelope(choices, [], chunk=True))

    async def events():
        items, started, sent = [], set(), {}
        try:
            try:
                async for batch in samples:           # what is new after an engine step: one write
                    out = []
                    finished, deltas = split(batch)
                    for item in finished:
                        key = (item.prompt_index, item.sample_index)
                        first = key not in started
                        started.add(key)
                        items.append(item)
                        r, st = item.result, text_of(key)
                        k = sent.pop(key, 0)         # tokens sent as deltas
                        rest = msgspec.structs.replace(r, token_ids=r.token_ids[k:], logprobs=r.logprobs[k:],
                                                       top_token_ids=r.top_token_ids[k:],
                                                       top_logprobs=r.top_logprobs[k:])
                        if w.chats:                  # the parsers' last delta and vLLM's finish reason
                            part = IndexedResult(*key, rest)
                            (delta, names), = await gw.in_tokenizer_thread(chat_deltas, [part], True)
                            choice = w.choice(part, "", names)
                            choice["message"] = {"role": "assistant"} | (delta or {})
                            called = key in w.streams and w.streams[key].called
                            choice["finish_reason"] = w.finish_reason(item, {"tool_calls": called})
                            out.append(chunk([choice], first, key))
                            texts.pop(key, None)
                            offsets.pop(key, None)
                            continue
                        piece = ""
                        if opts.text:                # the whole text, as a whole answer gives it
                            piece = st.finish(await gw.in_tokenizer_thread(gw.decode, r.token_ids))
                        out.append(chunk(await w.choices([IndexedResult(*key, rest)], [piece]), first, key))
                        texts.pop(key, None)
                        offsets.pop(key, None)
                    parts = [IndexedResult(i.prompt_index, i.sample_index,
                                           SeqResult(token_ids=i.delta.token_ids, logprobs=i.delta.logprobs,
                                                     finish_reason=None, policy_version=i.delta.version_spans[0][0],
                                                     version_spans=i.delta.version_spans,
                                                     top_token_ids=i.delta.top_token_ids,
                                                     top_logprobs=i.delta.top_logprobs)) for i in deltas]
                    # one hop to the tokenizer thread per engine step: every delta's text piece and names together
                    if not parts:
                        decoded = []
                    elif w.chats:
                        decoded = await gw.in_tokenizer_thread(chat_deltas, parts, False)
                    else:
                        decoded = await gw.in_tokenizer_thread(delta_texts, parts)
                    for i, part, (piece, names) in zip(deltas, parts, decoded):
                        key = (i.prompt_index, i.sample_index)
                        first = key not in started
                        started.add(key)
                        sent[key] = i.delta.start + len(i.delta.token_ids)
                        if w.chats:                  # the parsers' delta ({} while a tag is incomplete: the
                            choice = w.choice(part, "", names)       # tokens and log-probs still go out)
                            choice["message"] = {"role": "assistant"} | (piece or {})
                        else:
                            choice = w.choice(part, piece, names)
                        choice.pop("weight_versions")
                        out.append(chunk([choice], first, key))
                    yield "".join(out)
            except ServiceError as e:
                err = from_service_error(e, spelling)
                error = {"message": err.message, "param": err.param, "code": err.status}
                yield f"data: {json.dumps({'error': error})}\n\n"
            if opts.usage_in_stream:
                usage = w.envelope([], items, chunk=True) | {"usage": w.usage(items)}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await cm.__aexit__(None, None, None)

    return StreamingResponse(events(), media_type="text/event-stream", headers=gw.serving_headers())


async def _serve(request: Request, parse, spelling) -> Response:
    body = json_body(await request.body())
    req, opts = parse(body)
    gw = gateway(request)
    req.policy = gw.policy_of(body.get("model"))              # an adapter's name samples that LoRA adapter
    req.session_id = gw.session_key(request, body)
    return await _answer(request, gw, req, opts, spelling, body)


async def _answer(request: Request, gw, req, opts, spelling, body: dict) -> Response:
    """A parsed request's samples: as server-sent events when it asked to stream, else one JSON body."""
    if body.get("return_tokens_as_token_ids") is None:      # the server's default (--return-tokens-as-token-ids)
        opts.tokens_as_ids = gw.tokens_as_ids
    if opts.stream:
        return await _stream(gw, req, opts, spelling)
    return await until_disconnect(request, _collect(gw, req, opts, spelling))


@router.post("/v1/completions")
@answers_errors
async def completions(request: Request):
    """OpenAI completions: a text or token-id prompt (or a batch), n samples each, logprobs of the sampled
    token, return_token_ids, return_tokens_as_token_ids, stream."""
    return await _serve(request, parse_completion, SPELLING)


@router.post("/inference/v1/generate")
@answers_errors
async def generate_tokens(request: Request):
    """vLLM's tokens-in, tokens-out endpoint: `token_ids` and `sampling_params`."""
    return await _serve(request, parse_generate, GENERATE_SPELLING)


@router.get("/v1/models")
def models(request: Request) -> dict:
    """The base model, then every LoRA adapter served (vLLM lists each with its base as `parent`)."""
    gw = gateway(request)
    base = gw.model.path
    data = [{"id": base, "object": "model", "created": 0, "owned_by": "rollout-service", "root": base,
             "parent": None, "max_model_len": gw.model.max_model_len,
             "rollout": {"policy_version": gw.pool.policy_version, "draft_version": gw.pool.draft_version}}]
    for name in sorted(gw.pool.adapters.served()):
        a = gw.pool.adapters.adapters[name]
        data.append({"id": name, "object": "model", "created": 0, "owned_by": "rollout-service",
                     "root": str(a.versions[a.latest].path), "parent": base, "max_model_len": gw.model.max_model_len,
                     "rollout": {"policy_version": a.latest, "loaded_versions": sorted(a.versions)}})
    return {"object": "list", "data": data}


@router.post("/v1/load_lora_adapter")
@answers_errors
async def load_lora_adapter(request: Request):
    """vLLM's {"lora_name", "lora_path"}: a PEFT directory below --weights-root, committed on every engine as the
    name's next version ("version" picks it). Answers vLLM's text."""
    body = json_body(await request.body())
    out = await gateway(request).load_adapter(body.get("lora_name"), body.get("lora_path"), Fields(body).int("version"))
    return Response(f"Success: LoRA adapter '{out['lora_name']}' added successfully.", media_type="text/plain",
                    headers={"x-rollout-adapter-version": str(out["version"])})


@router.post("/v1/unload_lora_adapter")
@answers_errors
async def unload_lora_adapter(request: Request):
    """vLLM's {"lora_name"}: no new request may name it; its samples in flight finish, then it is unloaded."""
    out = await gateway(request).unload_adapter(json_body(await request.body()).get("lora_name"))
    return Response(f"Success: LoRA adapter '{out['lora_name']}' removed successfully.", media_type="text/plain")


@router.get("/health")
def health(request: Request) -> Response:
    """vLLM's health check: 200 while every engine is ready, 503 otherwise."""
    ready = gateway(request).pool.ready
    return Response(status_code=200 if ready else 503)


@router.get("/get_world_size")
def world_size(request: Request) -> dict:
    """The engines' worker ranks in a weight-transfer group (the trainer's ranks come on top)."""
    return {"world_size": gateway(request).vllm_transfer.world_size()}


@router.get("/server_info")
def server_info(request: Request) -> dict:
    """What trainers read of vLLM's /server_info?config_format=json: the model and its serving dtype."""
    return gateway(request).vllm_transfer.server_info()


@router.get("/weight_info")
def weight_info(request: Request) -> dict:
    return {"weight_version": str(gateway(request).pool.policy_version)}


# ---- control (admin token) -------------------------------------------------------------------------------
@router.post("/pause")
@answers_errors
async def pause(request: Request):
    """Pause generation: mode=abort (in-flight samples end with finish_reason "abort"), wait (finish them),
    keep (freeze them; they continue on /resume under whatever weights are loaded by then)."""
    await gateway(request).pause(in_flight_mode(request.query_params.get("mode", "abort")))
    return {"status": "paused"}


@router.post("/resume")
async def resume(request: Request):
    await gateway(request).resume()
    return {"status": "resumed"}


@router.get("/is_paused")
def is_paused(request: Request) -> dict:
    return {"is_paused": gateway(request).paused}


@router.post("/abort_requests")
@answers_errors
async def abort_requests(request: Request):
    ids = json_body(await request.body()).get("request_ids") or None
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise DialectError(400, "request_ids: must be a list of request ids", "request_ids")
    return {"status": "aborted", "aborted": gateway(request).abort(ids)}


@router.post("/reset_prefix_cache")
@answers_errors
async def reset_prefix_cache(request: Request):
    if not await gateway(request).reset_prefix_cache():
        raise DialectError(409, "the prefix cache could not be reset on every engine (requests running?)")
    return {"status": "ok", "success": True}          # vLLM 0.26 on answers {"success": bool}


@router.post("/update_weights")
@answers_errors
async def update_weights(request: Request):
    """Two forms. vLLM's weight transfer: {"update_info": {names, dtype_names, shapes}} between
    /start_weight_update and /finish_weight_update, the bytes over the group (compat/vllm_transfer.py).
    prime-rl's filesystem mode: {"weight_dir": path} -> LoadWeights' validated, all-or-nothing commit, as the
    next policy version (or "version")."""
    body = json_body(await request.body())
    if "update_info" in body:
        return await gateway(request).vllm_transfer.update(body["update_info"])
    if "weight_dir" not in body:
        raise DialectError(400, "weight_dir: required (a safetensors file or directory below the server's "
                                "--weights-root), or update_info (vLLM's weight transfer)", "weight_dir")
    f = Fields(body)
    path = f.get("weight_dir")
    if not isinstance(path, str) or not path:
        raise DialectError(400, "weight_dir: must be a path", "weight_dir")
    out = await gateway(request).load_policy(path, f.int("version"), in_flight_mode(f.get("mode", "wait")),
                                             LOAD_SPELLING)
    return {"status": "ok"} | out


# ---- vLLM's weight transfer (admin token): compat/vllm_transfer.py ---------------------------------------
@router.post("/init_weight_transfer_engine")
@answers_errors
async def init_weight_transfer_engine(request: Request):
    """{"init_info": {...}}: the group forms with the trainer (its rank 0 hosts the rendezvous); answers once
    every engine joined."""
    return await gateway(request).vllm_transfer.init(json_body(await request.body()),
                                                     caller=request.client.host if request.client else "")


@router.post("/start_weight_update")
@answers_errors
async def start_weight_update(request: Request):
    return gateway(request).vllm_transfer.start("policy", json_body(await request.body()))


@router.post("/start_draft_weight_update")
@answers_errors
async def start_draft_weight_update(request: Request):
    return gateway(request).vllm_transfer.start("draft", json_body(await request.body()))


@router.post("/finish_weight_update")
@answers_errors
async def finish_weight_update(request: Request):
    return gateway(request).vllm_transfer.finish(json_body(await request.body()))


@router.post("/shutdown_weight_transfer_engine")
@answers_errors
async def shutdown_weight_transfer_engine(request: Request):
    return await gateway(request).vllm_transfer.shutdown()
