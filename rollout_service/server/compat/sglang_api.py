"""SGLang's HTTP dialect (what slime and AReaL's SGLang backend call), as a thin translator onto the pool.

`meta_info.weight_version` is the policy version that produced a sample (SGLang's own field);
`meta_info.rollout` carries the version spans and drafter statistics, as in the vLLM dialect.
"""
from __future__ import annotations

import json
import uuid

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout_service.api import pb
from rollout_service.engine.types import SeqResult
from rollout_service.errors import ServiceError
from rollout_service.pool.requests import IndexedResult, Progress, split
from rollout_service.server.compat.dialect import FastJSONResponse, sse_event
from rollout_service.server.compat.routes import routes_raw_base64
from rollout_service.server.compat.gateway import (
    MIN_LOGPROB,
    DialectError,
    StreamText,
    Fields,
    Gateway,
    add_not_served,
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
# the contract's names as /generate spells them (gateway.spell)
SPELLING = {"sampling.max_tokens": "sampling_params.max_new_tokens", "sampling.": "sampling_params.",
            "prompts[": "input_ids[", "n": "sampling_params.n", "request_id": "rid",
            "top_logprobs": "top_logprobs_num"}
# and as /update_weights_from_disk does (LoadWeights)
LOAD_SPELLING = {"LoadWeights": "update_weights_from_disk", "path": "model_path", "version": "weight_version"}
# SGLang's pause modes -> the engines' in-flight modes
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


def parse_generate(body: dict) -> tuple[pb.GenerateRequest, bool, bool, bool]:
    """-> (request, batched, return_logprob, stream)."""
    f = Fields(body)
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise DialectError(400, "sampling_params: one object for the whole batch (a list per prompt is not "
                                "supported)", "sampling_params")
    if sp.get("seed") is None and sp.get("sampling_seed") is not None:       # SGLang's name for it
        sp = sp | {"seed": sp["sampling_seed"]}
    sf = Fields(sp, "sampling_params.")
    sf.unsupported("min_new_tokens", 0, "min_new_tokens is not supported (it changes the sampled distribution)")
    sf.unsupported("json_schema", None, "constrained decoding is not supported")
    sf.unsupported("regex", None, "constrained decoding is not supported")
    req = pb.GenerateRequest(sampling=sampling_params(sf, "max_new_tokens"))
    if sp.get("max_new_tokens") is None:
        req.sampling.max_tokens = 128                  # SGLang's default
    n = sf.int("n", 1)
    req.n = max(min(n, 2**31 - 1), -(2**31))
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise DialectError(400, "text / input_ids: set exactly one of them", "input_ids")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise DialectError(400, "text: must be a string or a non-empty list of strings", "text")
        req.prompts.extend(pb.Prompt(text=t) for t in texts)
    else:
        if not isinstance(ids, list) or not ids:
            raise DialectError(400, "input_ids: must be a list of token ids or a list of such lists", "input_ids")
        batched = isinstance(ids[0], list)
        lists = ids if batched else [ids]
        if batched and not all(isinstance(x, list) for x in lists):
            raise DialectError(400, "input_ids: mixes token ids and lists of them", "input_ids")
        req.prompts.extend(token_prompt(x, f"input_ids[{i}]" if batched else "input_ids") for i, x in enumerate(lists))
    rid = body.get("rid")
    if rid is not None:
        if not isinstance(rid, str):
            raise DialectError(400, "rid: one string for the request (a list per prompt is not supported)", "rid")
        req.request_id = rid
    f.unsupported("return_text_in_logprobs", False, "token texts in log-probs are not served")
    f.unsupported("logprob_start_len", -1, "prompt log-probs are not served")
    top = f.int("top_logprobs_num", 0)
    if top and not f.bool("return_logprob"):
        raise DialectError(400, "top_logprobs_num: needs \"return_logprob\": true", "top_logprobs_num")
    req.top_logprobs = max(min(top, 2**31 - 1), -(2**31))          # validation names the range
    stream = f.bool("stream")
    req.stream_tokens = stream
    req.return_partial = True            # as SGLang: an aborted sample answers the tokens it has
    req.return_routed_experts = f.bool("return_routed_experts")   # meta_info.routed_experts (routing replay)
    return req, batched, f.bool("return_logprob"), stream


ABORTED = "aborted (an abort-mode weight update, pause or abort request)"


def _finish(r) -> dict | None:
    if r.finish_reason is None:                  # a streamed sample that goes on
        return None
    if r.finish_reason == "abort":               # the tokens so far come with it: continue from them
        return {"type": "abort", "message": ABORTED}
    if r.finish_reason == "length":
        return {"type": "length", "length": len(r.token_ids)}
    matched = r.stop_string or (r.token_ids[-1] if r.token_ids else None)
    return {"type": "stop", "matched": matched}


def _sample(item, text: str, prompt_len: int, rid: str, return_logprob: bool) -> dict:
    r = item.result
    meta = {"id": rid, "finish_reason": _finish(r), "prompt_tokens": prompt_len,
            "completion_tokens": len(r.token_ids), "cached_tokens": r.num_cached_tokens,
            "weight_version": str(r.policy_version), "rollout": rollout_fields(r)}
    if r.num_drafted:
        meta["spec_verify_ct"] = r.num_drafted
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.token_ids)]
        if r.top_token_ids:       # SGLang's shape: per position [[logprob, token_id, text], ...], most likely first
            meta["output_top_logprobs"] = [[[max(lp, MIN_LOGPROB), t, None] for t, lp in zip(ts, ls)]
                                           for ts, ls in zip(r.top_token_ids, r.top_logprobs)]
    if r.routed_experts is not None and r.finish_reason is not None:
        meta["routed_experts"] = routes_raw_base64(r.routed_experts)    # as SGLang: raw int32, [tokens - 1, L, K]
    return {"text": text, "output_ids": r.token_ids, "meta_info": meta}


def _aborted(rid: str, prompt_len: int, return_logprob: bool, policy_version: int) -> dict:
    meta = {"id": rid, "finish_reason": {"type": "abort", "message": ABORTED},
            "prompt_tokens": prompt_len, "completion_tokens": 0, "weight_version": str(policy_version)}
    if return_logprob:
        meta["output_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}


async def _run(gw: Gateway, req: pb.GenerateRequest, batched: bool, return_logprob: bool) -> Response:
    async with gw.generate(req, SPELLING) as (checked, samples):
        items, aborted = [], False
        try:
            async for item in samples:
                items.append(item)
        except ServiceError as e:
            if e.code != grpc.StatusCode.ABORTED:
                raise from_service_error(e, SPELLING) from None
            aborted = True
    texts = await gw.in_tokenizer_thread(lambda: [gw.decode(i.result.token_ids) for i in items])
    rid = req.request_id or uuid.uuid4().hex
    n = req.n or 1
    out: list = [None] * (len(checked.prompt_token_ids) * n)
    for item, text in zip(items, texts):
        out[item.prompt_index * n + item.sample_index] = _sample(
            item, text, len(checked.prompt_token_ids[item.prompt_index]), rid, return_logprob)
    if aborted:
        for i, v in enumerate(out):
            if v is None:
                out[i] = _aborted(rid, len(checked.prompt_token_ids[i // n]), return_logprob, gw.pool.policy_version)
    body = out if batched or n > 1 else out[0]
    return FastJSONResponse(body, headers=rollout_headers(items))


async def _stream(gw: Gateway, req: pb.GenerateRequest, batched: bool, return_logprob: bool) -> Response:
    """SGLang's streamed /generate: a server-sent event per engine step and sample, each carrying the sample so far
    (SGLang's default, non-incremental output: cumulative `text`, `output_ids`, `meta_info` with finish_reason null
    until the last), `index` = prompt * n + sample for a batch or n > 1; then `data: [DONE]`."""
    cm = gw.generate(req, SPELLING, deltas=True)
    checked, samples = await cm.__aenter__()          # a refusal here raises DialectError: a plain HTTP error
    rid = req.request_id or uuid.uuid4().hex
    n = req.n or 1
    progress: dict[tuple[int, int], Progress] = {}
    texts: dict[tuple[int, int], StreamText] = {}

    def event(key, r, text: str) -> str:
        out = _sample(IndexedResult(*key, r), text, len(checked.prompt_token_ids[key[0]]), rid, return_logprob)
        if batched or n > 1:
            out["index"] = key[0] * n + key[1]
        return sse_event(out)

    async def events():
        try:
            try:
                async for batch in samples:           # what is new after an engine step: one write
                    out = []
                    finished, deltas = split(batch)
                    for item in finished:
                        key = (item.prompt_index, item.sample_index)
                        progress.pop(key, None)
                        texts.pop(key, None)
                        text = await gw.in_tokenizer_thread(gw.decode, item.result.token_ids)
                        out.append(event(key, item.result, text))
                    steps = [(texts.setdefault((i.prompt_index, i.sample_index), StreamText(gw.decode)),
                              i.delta.token_ids) for i in deltas]
                    if steps:                         # one hop to the tokenizer thread per engine step
                        await gw.in_tokenizer_thread(lambda: [st.step(ids) for st, ids in steps])
                    for i, (st, _) in zip(deltas, steps):
                        key = (i.prompt_index, i.sample_index)
                        prog = progress.setdefault(key, Progress())
                        prog.extend(i.delta)          # this reader's deltas follow each other
                        r = SeqResult(token_ids=prog.token_ids, logprobs=prog.logprobs, finish_reason=None,
                                      policy_version=prog.version_spans[0][0], version_spans=prog.version_spans,
                                      top_token_ids=prog.top_token_ids, top_logprobs=prog.top_logprobs)
                        out.append(event(key, r, st.sent))
                    yield "".join(out)
            except ServiceError as e:
                err = from_service_error(e, SPELLING)
                yield f"data: {json.dumps({'error': {'message': err.message, 'param': err.param}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await cm.__aexit__(None, None, None)

    return StreamingResponse(events(), media_type="text/event-stream", headers=gw.serving_headers())


@router.post("/generate")
@answers_errors
async def generate(request: Request):
    """`text` or `input_ids` (one prompt or a batch), `sampling_params`, `return_logprob`, `top_logprobs_num`,
    `stream`."""
    gw = gateway(request)
    body = json_body(await request.body())
    req, batched, return_logprob, stream = parse_generate(body)
    req.session_id = gw.session_key(request, body)
    req.policy = gw.policy_of(_lora_path(body), "lora_path")     # SGLang's per-request adapter
    if stream:
        return await _stream(gw, req, batched, return_logprob)
    return await until_disconnect(request, _run(gw, req, batched, return_logprob))


def _lora_path(body: dict):
    """SGLang's `lora_path`: one adapter name, or one per prompt of a batch (all the same here: a request samples one
    policy)."""
    lora = body.get("lora_path")
    if isinstance(lora, list):
        names = {x for x in lora if x is not None}
        if len(names) > 1:
            raise DialectError(400, "lora_path: one adapter per request here (got "
                                    f"{sorted(map(str, names))}); send one request per adapter", "lora_path")
        return next(iter(names), None)
    return lora


@router.post("/load_lora_adapter")
@answers_errors
async def load_lora_adapter(request: Request):
    """SGLang's {"lora_name", "lora_path"} (as the vLLM dialect's /v1/load_lora_adapter)."""
    body = json_body(await request.body())
    out = await gateway(request).load_adapter(body.get("lora_name"), body.get("lora_path"), Fields(body).int("version"))
    return {"success": True, "message": f"LoRA adapter '{out['lora_name']}' loaded"} | out


@router.post("/unload_lora_adapter")
@answers_errors
async def unload_lora_adapter(request: Request):
    out = await gateway(request).unload_adapter(json_body(await request.body()).get("lora_name"))
    return {"success": True, "message": f"LoRA adapter '{out['lora_name']}' unloaded"} | out


@router.get("/health_generate")
@answers_errors
async def health_generate(request: Request):
    """SGLang's deep health check: one greedy token through the pool."""
    gw = gateway(request)
    if not gw.pool.ready:
        return Response(status_code=503)
    req = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=[0])], sampling=pb.SamplingParams(temperature=0,
                                                                                            max_tokens=1))
    async with gw.generate(req) as (_, samples):
        async for _ in samples:
            pass
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")                   # SGLang's newer name (sglang-router asks it first)
def model_info(request: Request) -> dict:
    gw = gateway(request)
    return {"model_path": gw.model.path, "tokenizer_path": gw.model.path, "is_generation": True,
            "weight_version": str(gw.pool.policy_version)}


@router.get("/get_weight_version")
def weight_version(request: Request) -> dict:
    return {"weight_version": str(gateway(request).pool.policy_version)}


@router.post("/update_weights_from_disk")
@answers_errors
async def update_weights_from_disk(request: Request):
    """{"model_path", "weight_version"?, "abort_all_requests"?} -> LoadWeights' validated, all-or-nothing
    commit. Without a weight_version, the next integer. abort_all_requests: in-flight samples end with
    finish_reason abort; otherwise they finish first."""
    body = json_body(await request.body())
    f = Fields(body)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise DialectError(400, "model_path: required, a safetensors file or directory below the server's "
                                "--weights-root", "model_path")
    f.unsupported("load_format", None, "only safetensors files are loaded")
    version = body.get("weight_version")
    if version is not None:
        if not (isinstance(version, int) or (isinstance(version, str) and version.strip().isdigit())):
            raise DialectError(400, f"weight_version: must be an integer (or a string of digits), got {version!r:.40}",
                               "weight_version")
        version = int(version)
    mode = "abort" if f.bool("abort_all_requests") else "wait"
    gw = gateway(request)
    try:
        out = await gw.load_policy(path, version, mode, LOAD_SPELLING)
    except DialectError as e:
        return JSONResponse({"success": False, "message": e.message}, status_code=e.status)
    return {"success": True, "message": f"Succeeded to update model weights (policy version {out['version']}).",
            "num_paused_requests": 0, "weight_version": str(out["version"]), "rollout": out}


@router.post("/pause_generation")
@answers_errors
async def pause_generation(request: Request):
    mode = json_body(await request.body()).get("mode", "abort")
    await gateway(request).pause(PAUSE_MODES[in_flight_mode(mode, tuple(PAUSE_MODES))])
    return {"status": "paused"}


@router.post("/continue_generation")
async def continue_generation(request: Request):
    await gateway(request).resume()
    return {"status": "resumed"}


@router.post("/abort_request")
@answers_errors
async def abort_request(request: Request):
    body = json_body(await request.body())
    f = Fields(body)
    rid = body.get("rid")
    if not f.bool("abort_all") and not isinstance(rid, str):
        raise DialectError(400, "rid: the request id to abort (or \"abort_all\": true)", "rid")
    return {"aborted": gateway(request).abort(None if f.bool("abort_all") else [rid])}


@router.api_route("/flush_cache", methods=["GET", "POST"])         # as SGLang (slime's engine sends a GET)
@answers_errors
async def flush_cache(request: Request):
    if not await gateway(request).reset_prefix_cache():
        raise DialectError(409, "the cache could not be flushed on every engine (requests running?)")
    return Response("Cache flushed.", status_code=200)


add_not_served(router, ("/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
                        "/update_weights_from_ipc", "/destroy_weights_update_group"))
