"""The rest of vLLM's server that RL frameworks call, beside completions and weight transfer (vllm_api.py):

    POST /tokenize {"prompt" | "messages", ...}  -> {count, max_model_len, tokens, token_strs}   (vLLM's shapes)
    POST /detokenize {"tokens"}                  -> {prompt}
    POST /collective_rpc {"method", "kwargs"}    -> {"results": [...]}: only the methods of SkyRL's worker extension
                                                    (NewInferenceWorkerWrap) that drive vLLM's weight transfer

SkyRL's RemoteInferenceClient (skyrl 0.3.0) tokenizes and detokenizes over HTTP when it has no local tokenizer, and
brackets its weight broadcast with /collective_rpc calls to its own worker extension (skyrl_start_weight_update,
update_weights_nccl, skyrl_finish_weight_update) instead of vLLM's /start_weight_update, /update_weights and
/finish_weight_update. Here those three methods are those three endpoints (compat/vllm_transfer.py); no worker code
of a client runs in the engines, so any other method is a 501 naming the ones served.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from rollout_service.server.compat.gateway import (DialectError, Fields, answers_errors, from_service_error, gateway,
                                                   json_body)

router = APIRouter()


def _tokenize(gw, body: dict) -> dict:
    """vLLM's TokenizeCompletionRequest ({"prompt", "add_special_tokens"}) or TokenizeChatRequest ({"messages",
    "add_generation_prompt", "chat_template_kwargs"}); blocking: runs in the tokenizer thread."""
    f = Fields(body)
    tok = gw.model.tokenizer
    if "messages" in body:                        # rendered as a chat request's prompt is (tools included)
        from rollout_service.chat.render import render
        from rollout_service.chat.request import check_chat
        from rollout_service.errors import ServiceError

        try:
            ids, _ = render(tok, check_chat(body, answered=False))   # pieces of a conversation
        except ServiceError as e:
            raise from_service_error(e) from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise DialectError(400, "prompt: required, a string (or give messages)", "prompt")
        ids = list(tok(prompt, add_special_tokens=f.bool("add_special_tokens", True))["input_ids"])
    out = {"count": len(ids), "max_model_len": gw.model.max_model_len, "tokens": ids, "token_strs": None}
    if f.bool("return_token_strs"):
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


@router.post("/tokenize")
@answers_errors
async def tokenize(request: Request):
    gw = gateway(request)
    body = json_body(await request.body())
    return await gw.in_tokenizer_thread(_tokenize, gw, body)


@router.post("/detokenize")
@answers_errors
async def detokenize(request: Request):
    """{"tokens": [ids]} -> {"prompt": text}, special tokens kept (vLLM decodes a prompt so)."""
    gw = gateway(request)
    body = json_body(await request.body())
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DialectError(400, "tokens: required, a list of token ids", "tokens")
    bad = next((t for t in ids if not 0 <= t < gw.model.vocab_size), None)
    if bad is not None:
        raise DialectError(400, f"tokens: {bad} is outside the vocabulary (0 to {gw.model.vocab_size - 1})", "tokens")
    text = await gw.in_tokenizer_thread(lambda: gw.model.tokenizer.decode(ids, skip_special_tokens=False))
    return {"prompt": text}


# SkyRL's worker-extension methods (skyrl.backends.skyrl_train.inference_servers.new_inference_worker_wrap) -> what
# they do, as vLLM's own weight-transfer endpoints
SKYRL_METHODS = ("skyrl_start_weight_update", "update_weights_nccl", "skyrl_finish_weight_update")


@router.post("/collective_rpc")
@answers_errors
async def collective_rpc(request: Request):
    """vLLM's /collective_rpc for SkyRL's weight-update methods. One result per engine worker, as vLLM answers."""
    body = json_body(await request.body())
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise DialectError(400, "method: required, the name of a worker method", "method")
    kwargs = body.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise DialectError(400, "kwargs: must be an object", "kwargs")
    if method not in SKYRL_METHODS:
        served = ", ".join(SKYRL_METHODS)
        raise DialectError(501, f"method: {method!r} is not served; this service runs no worker extension of a "
                                f"client's, and answers only SkyRL's weight-update methods ({served}) through vLLM's "
                                "weight transfer (or call /start_weight_update, /update_weights, /finish_weight_update "
                                "directly)", "method")
    transfer = gateway(request).vllm_transfer
    if method == "skyrl_start_weight_update":
        out = transfer.start("policy", {k: v for k, v in kwargs.items() if k == "is_checkpoint_format"})
    elif method == "update_weights_nccl":
        if "update_info" not in kwargs:
            raise DialectError(400, "kwargs.update_info: required ({names, dtype_names, shapes})",
                               "kwargs.update_info")
        out = await transfer.update(kwargs["update_info"])
    else:
        out = transfer.finish({})
    return {"results": [out] * max(1, transfer.world_size())}
