"""What the HTTP dialects share: the service layer gRPC calls too (server/service.py: the one admission path, weight
loads through the same commit as LoadWeights, the weight-transfer group), ServiceError -> HTTP status, and the
extension fields that tell every answer's policy version(s) and drafter statistics.

A dialect parses its JSON into a GenerateRequest (rejecting what it cannot serve, naming the field), runs it
here, and writes the samples in its own shape. Nothing here knows a dialect.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import grpc
from fastapi import Request

from rollout_service.api import pb
from rollout_service.errors import ServiceError
from rollout_service.server.compat.dialect import (  # noqa: F401 - the dialects' shared words, re-exported here
    ERROR_TYPE, HTTP_STATUS, DialectError, Fields, Spelling, error_response, from_service_error, json_body, spell)
from rollout_service.server.compat.vllm_transfer import VllmWeightTransfer
from rollout_service.server.service import TOKENIZER, RolloutService
from rollout_service.validation import CheckedRequest, session_id_problem
from rollout_service.wire import IN_FLIGHT_MODES

MIN_LOGPROB = -9999.0          # vLLM's JSON for a log-prob of -inf (a token that top-k / top-p rules out)



def rollout_fields(r) -> dict:
    """The extension every sample carries: which policy version(s) produced it, with which drafter."""
    return {"policy_version": r.policy_version,
            "version_spans": [{"policy_version": v, "first_token": t} for v, t in r.version_spans],
            "draft_version": r.draft_version, "num_drafted": r.num_drafted, "num_accepted": r.num_accepted}


def rollout_headers(results) -> dict[str, str]:
    """Response headers summing the samples: policy versions that produced them, drafter version, counts."""
    rs = [item.result for item in results]
    versions = sorted({v for r in rs for v, _ in r.version_spans} | {r.policy_version for r in rs})
    return {"x-rollout-policy-versions": ",".join(map(str, versions)),
            "x-rollout-draft-versions": ",".join(map(str, sorted({r.draft_version for r in rs}))),
            "x-rollout-num-drafted": str(sum(r.num_drafted for r in rs)),
            "x-rollout-num-accepted": str(sum(r.num_accepted for r in rs))}


class StreamText:
    """A streamed sample's text, piece by piece, decoding a few tokens per step (as vLLM's incremental detokenizer
    does, not the whole sample every step): the tokens since the last piece, decoded after the ones of the piece
    before (so that a word's leading space and a character split over tokens come out right), minus the text those
    decode to. An incomplete character (U+FFFD at the end) waits for its next token. `sent`: the text so far."""

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0          # ids[prefix:read]: the last piece's tokens, decoded again as context
        self.sent = ""

    def step(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""
        piece = text[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.sent += piece
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the whole sample's text (empty where the pieces sent do not lead it)."""
        return final_text[len(self.sent):] if final_text.startswith(self.sent) else ""


class Gateway:
    """The service layer's data and control plane (server/service.py, what the gRPC servicer calls too), called from
    HTTP handlers."""

    def __init__(self, service: RolloutService, session_key_from=None, tokens_as_ids: bool = False):
        from rollout_service.config import SESSION_KEY_FROM

        self.service = service
        self.tokens_as_ids = tokens_as_ids          # the vLLM dialect's default for return_tokens_as_token_ids
        self.session_key_from = list(SESSION_KEY_FROM if session_key_from is None else session_key_from)
        self.pool = service.pool
        self.vllm_transfer = VllmWeightTransfer(service)   # vLLM's weight-transfer endpoints' state

    @property
    def model(self):
        return self.service.model

    def serving_headers(self) -> dict[str, str]:
        return {"x-rollout-policy-version": str(self.pool.policy_version),
                "x-rollout-draft-version": str(self.pool.draft_version)}

    @contextlib.asynccontextmanager
    async def generate(self, request: pb.GenerateRequest, spelling: Spelling | None = None, deltas: bool = False,
                       fill_context: bool = False) -> AsyncIterator[tuple[CheckedRequest, AsyncIterator]]:
        """Admit `request` exactly as gRPC Generate does; yield (checked, samples as they finish). With deltas
        (streaming: request.stream_tokens), lists instead: what is new after each engine step, the samples that
        finished and each unfinished sample's new tokens as an IndexedDelta (RequestRecord.batches). Leaving the block
        before the last sample (the HTTP client went away) aborts the engine work, as a cancelled stream does. Raises
        DialectError for a refusal at admission; errors after it stay ServiceError. fill_context: an unset max_tokens
        fills each prompt's context (vLLM's chat)."""
        telemetry = self.pool.telemetry
        try:
            checked, record = await self.service.admit(request, fill_context=fill_context)
        except ServiceError as e:
            telemetry.m_requests.labels(e.code.name).inc()
            raise from_service_error(e, spelling) from None
        self.pool.attach(record)
        code = "OK"
        try:
            yield checked, record.batches(deltas=True) if deltas else record.read()
        except ServiceError as e:
            code = e.code.name
            raise
        except BaseException:
            code = "CANCELLED"
            raise
        finally:
            self.pool.detach(record)
            telemetry.m_requests.labels(code).inc()

    def session_key(self, request: Request, body: dict) -> str:
        """A dialect request's session key (GenerateRequest.session_id): the first name of session_key_from present
        as a header, else as a top-level field of the body (a string, or an integer as its text); "" for none.
        A bad one is a 400 naming the header or field it came from."""
        for name in self.session_key_from:
            value, where = request.headers.get(name), f"header {name}"
            if value is None:
                value, where = body.get(name), name
                if value is None:
                    continue
                if isinstance(value, int) and not isinstance(value, bool):
                    value = str(value)
                if not isinstance(value, str):
                    raise DialectError(400, f"{name}: a session key must be a string, got {value!r:.60}", name)
            problem = session_id_problem(value)
            if problem:
                raise DialectError(400, f"{where}: not a valid session key ({problem})", name)
            if value:
                return value
        return ""

    def decode(self, ids: list[int]) -> str:
        """A sample's text (blocking: call in the tokenizer thread)."""
        return self.model.decode(ids)

    async def in_tokenizer_thread(self, fn, *args):
        """Tokenizer work (decoding, chat templates) off the event loop, on the thread gRPC uses for it."""
        return await asyncio.get_running_loop().run_in_executor(TOKENIZER, fn, *args)

    async def load_policy(self, path: str, version: int | None, mode: str, spelling: Spelling) -> dict:
        """Weights from a path: LoadWeights' validated, all-or-nothing commit (security.weights_roots apply).
        version None: the next integer after the serving one. spelling: the endpoint's names for LoadWeights and
        its fields (path, version)."""
        weights = self.service.weights
        if version is None:
            version = self.pool.policy_version + 1
        try:
            out = await weights.load(path, version, "policy", mode, False)
        except ServiceError as e:
            raise from_service_error(e, spelling) from None
        return {"version": out.version, "num_tensors": out.num_tensors, "num_bytes": out.num_bytes,
                "total_s": round(out.total_s, 3), "pause_s": round(out.pause_s, 3)}

    def policy_of(self, model, field: str = "model") -> str:
        """A dialect's model name -> GenerateRequest.policy: a served adapter's name is that adapter; the base
        model's path or name (or none) is the base policy. With LoRA on, any other name is a 404 naming the field (as
        vLLM answers an unknown model); with LoRA off the name is not checked (as before adapters)."""
        adapters = self.pool.adapters
        if not model or not adapters.enabled:
            return ""
        if not isinstance(model, str):
            raise DialectError(400, f"{field}: must be a string (the base model or an adapter's name)", field)
        if model in adapters.served():
            return model
        base = self.model.path
        if model in (base, base.rstrip("/").rsplit("/", 1)[-1]):
            return ""
        served = ", ".join([base, *sorted(adapters.served())])
        raise DialectError(404, f"{field}: the model `{model}` does not exist (served: {served})", field)

    async def load_adapter(self, name, path, version) -> dict:
        """vLLM's and SGLang's /load_lora_adapter: LoadWeights of a PEFT directory as the adapter's next version (or
        `version`): a name already served gets a new version (its samples in flight finish on theirs)."""
        if not isinstance(name, str) or not name:
            raise DialectError(400, "lora_name: required, the adapter's name", "lora_name")
        if not isinstance(path, str) or not path:
            raise DialectError(400, "lora_path: required, a PEFT adapter directory below the server's --weights-root",
                               "lora_path")
        a = self.pool.adapters.adapters.get(name)
        if version is None:
            version = (a.latest if a is not None and not a.unloading else 0) + 1
        spelling = {"LoadWeights": "load_lora_adapter", "path": "lora_path", "adapter": "lora_name"}
        try:
            out = await self.service.weights.load(path, version, "adapter", "wait", False, adapter=name)
        except ServiceError as e:
            raise from_service_error(e, spelling) from None
        return {"lora_name": name, "version": out.version, "num_tensors": out.num_tensors,
                "num_bytes": out.num_bytes, "total_s": round(out.total_s, 3)}

    async def unload_adapter(self, name) -> dict:
        if not isinstance(name, str) or not name:
            raise DialectError(400, "lora_name: required, the adapter's name", "lora_name")
        try:
            a = await self.service.unload_adapter(name)
        except ServiceError as e:
            raise from_service_error(e, {"name": "lora_name"}) from None
        return {"lora_name": a.name, "version": a.version}

    async def pause(self, mode: str) -> None:
        await self.service.pool.hold(mode)

    async def resume(self) -> None:
        await self.service.pool.release()

    @property
    def paused(self) -> bool:
        return self.service.pool.held is not None

    def abort(self, request_ids: list[str] | None) -> int:
        """Fail the named requests (None: every unfinished one) with ABORTED; their engine work stops."""
        aborted = 0
        for rec in list(self.pool.live):
            if request_ids is None or rec.request_id in request_ids:
                self.pool._fail(rec, ServiceError(grpc.StatusCode.ABORTED, "aborted by an operator's abort request"))
                aborted += 1
        return aborted

    async def reset_prefix_cache(self) -> bool:
        """Every serving engine's prefix cache, paused ones too (SGLang flushes while generation is paused: slime
        calls /flush_cache between /update_weights_from_disk and /continue_generation); False where one refused
        (vLLM does while requests hold cache blocks)."""
        live = ("READY", "PAUSED")
        done = await asyncio.gather(*(e.reset_prefix_cache() for e in self.pool.engines if e.state.name in live))
        return bool(done) and all(done)


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def answers_errors(handler):
    """Decorate a handler: a DialectError it raises becomes the error answer (400 naming the field, 429, ...)."""
    @functools.wraps(handler)
    async def wrapped(request: Request):
        try:
            return await handler(request)
        except DialectError as e:
            return error_response(e)
    return wrapped


def no_collectives(what: str) -> DialectError:
    return DialectError(501, f"{what}: SGLang's collective weight transfer (NCCL / CUDA IPC) is not served; use "
                             "vLLM's weight-transfer endpoints (/init_weight_transfer_engine, /start_weight_update, "
                             "/update_weights {\"update_info\"}, /finish_weight_update), or write the weights as "
                             "safetensors below the server's --weights-root and POST /update_weights_from_disk "
                             "(or gRPC LoadWeights / PushWeights)")


def add_not_served(router, paths: tuple[str, ...]) -> None:
    """Register each weight-transfer path this service does not serve: 501 naming the ones it does."""
    def answer(path: str):
        async def not_served():
            return error_response(no_collectives(path))
        return not_served
    for path in paths:
        router.add_api_route(path, answer(path), methods=["POST"])


def in_flight_mode(value, modes=IN_FLIGHT_MODES) -> str:
    if value not in modes:
        raise DialectError(400, f"mode: must be one of {', '.join(modes)}, got {value!r:.40}", "mode")
    return value


async def until_disconnect(request: Request, work):
    """Run `work` (a coroutine) but cancel it when the HTTP client disconnects (vLLM's with_cancellation):
    a trainer that gives up on a request frees its engine slots."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise DialectError(499, "the client disconnected")
    return task.result()


def sampling_params(f: Fields, max_tokens_key: str) -> pb.SamplingParams:
    """The sampling fields both dialects share (their names match vLLM's and SGLang's, bar max tokens)."""
    sp = pb.SamplingParams()
    for key in ("temperature", "top_p"):
        v = f.float(key)
        if v is not None:
            setattr(sp, key, v)
    top_k = f.int("top_k")
    if top_k is not None:
        sp.top_k = max(min(top_k, 2**31 - 1), -(2**31))     # validation names the range
    max_tokens = f.int(max_tokens_key)
    if max_tokens is not None:
        sp.max_tokens = max(min(max_tokens, 2**31 - 1), -(2**31))
    seed = f.int("seed")
    if seed is not None:
        if seed < 0:
            raise DialectError(400, f"{f.prefix}seed: must be >= 0, got {seed}", f.prefix + "seed")
        sp.seed = seed % 2**64
    sp.stop.extend(f.str_list("stop"))
    ids = f.int_list("stop_token_ids")
    if any(not -(2**31) <= t < 2**31 for t in ids):
        raise DialectError(400, f"{f.prefix}stop_token_ids: outside the vocabulary", f.prefix + "stop_token_ids")
    sp.stop_token_ids.extend(ids)
    sp.ignore_eos = f.bool("ignore_eos")
    for key, default in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        f.unsupported(key, default, "penalties change the sampled distribution away from the policy's; "
                                    "this service samples the policy only (leave it at its default)")
    f.unsupported("min_p", 0, "min_p is not supported (use top_p or top_k); 0 (TRL's and vLLM's default) is "
                              "accepted")
    return sp


def token_prompt(ids: list, where: str) -> pb.Prompt:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DialectError(400, f"{where}: token ids must be integers", where)
    if any(not -(2**31) <= t < 2**31 for t in ids):
        bad = next(t for t in ids if not -(2**31) <= t < 2**31)
        raise DialectError(400, f"{where}.token_ids: {bad} is outside the vocabulary", where)
    return pb.Prompt(token_ids=ids)
