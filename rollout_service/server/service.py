"""The service layer: what both front doors call, the gRPC servicer (grpc_service.py) and the HTTP dialects
(compat/, through compat/gateway.py). It holds the pool, the model, the request limits, the weights and the
weight-transfer group, and admits a request the one way (check, then submit to the pool). Neither front door
calls the other."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import msgspec

from rollout_service.api import pb
from rollout_service.chat.parse import Parsing
from rollout_service.errors import ServiceError, about_field
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.requests import RequestRecord
from rollout_service.validation import CheckedRequest, Limits, check_generate
from rollout_service.weights.service import WeightService
from rollout_service.weights.transfer import WeightTransfer

TOKENIZER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
HEAVY_REQUEST_BYTES = 256 << 10      # checked in TOKENIZER's thread above this size (or with text prompts)


class RolloutService:
    def __init__(self, pool: EnginePool, model: ModelInfo, limits: Limits, weights: WeightService,
                 transfer: WeightTransfer, parsing: Parsing | None = None):
        self.pool = pool
        self.parsing = parsing or Parsing(getattr(model, "tokenizer", None))   # chat: tool-call and reasoning parsers
        self.model = model
        self.limits = limits
        self.weights = weights
        self.transfer = transfer

    async def admit(self, request: pb.GenerateRequest, tenant=None, fill_context: bool = False
                    ) -> tuple[CheckedRequest, RequestRecord]:
        """Check a request and admit it to the pool (or find the record it retries): the one admission path,
        shared by Generate and the HTTP dialects. tenant: the caller's (auth.Tenant; its scope was checked, its
        quota and fair share apply here; None: the HTTP request's, auth.CALLER_TENANT). fill_context: see
        check_generate. Raises ServiceError."""
        from rollout_service.server.auth import CALLER_TENANT, check_scope

        tenant = tenant or CALLER_TENANT.get()
        check_scope(tenant, None, request.policy, "sample")
        if any(p.text or p.HasField("chat") for p in request.prompts) or request.ByteSize() > HEAVY_REQUEST_BYTES:
            # tokenising text (chat templates) and hashing a large request take milliseconds to seconds:
            # not on the event loop. One thread: a Hugging Face tokenizer is not safe to share across threads.
            checked = await asyncio.get_running_loop().run_in_executor(
                TOKENIZER, check_generate, request, self.model, self.limits, self.parsing, fill_context)
        else:
            checked = check_generate(request, self.model, self.limits, self.parsing, fill_context)
        if checked.policy:
            self._on_adapter(checked, request.min_policy_version)
        else:
            if request.min_policy_version > self.pool.policy_version:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"min_policy_version={request.min_policy_version} but the service serves "
                                   f"policy version {self.pool.policy_version}; push newer weights first or "
                                   "lower min_policy_version")
            if checked.policy_version and checked.policy_version != self.pool.policy_version:
                raise about_field(grpc.StatusCode.FAILED_PRECONDITION, "policy_version",
                                  f"{checked.policy_version} but the service serves base policy version "
                                  f"{self.pool.policy_version} (only the serving version of the base policy can be "
                                  "sampled); leave it 0", sep=" ")
        return checked, self.pool.submit(checked.request_id, checked.fingerprint, checked.groups,
                                         session=checked.session_id, partials=checked.partials,
                                         return_partial=checked.return_partial,
                                         tenant=tenant.name if tenant else "",
                                         quota=tenant.max_sequences if tenant else 0)

    def render(self, chat: pb.ChatPrompt, with_text: bool = False, where: str = "chat.") -> tuple[list[int], int, str]:
        """Render (and the vLLM dialect's render endpoint): a chat prompt's token ids, how many lead from its prefix,
        and (with_text) their text. Blocking: the tokenizer thread."""
        from rollout_service.chat.render import render
        from rollout_service.chat.request import from_proto

        prompt = from_proto(chat, where)
        self.parsing.check(prompt, where)
        ids, num_prefix = render(self.model.tokenizer, prompt, where)
        text = self.model.tokenizer.decode(ids, skip_special_tokens=False) if with_text else ""
        return ids, num_prefix, text

    def parse(self, token_ids: list[int], chat: pb.ChatPrompt, prompt_ids: list[int], where: str = "chat."):
        """Parse: generated token ids -> chat.parse.Message. Blocking: the tokenizer thread."""
        from rollout_service.chat.request import from_proto
        from rollout_service.errors import invalid_field

        bad = next((t for t in token_ids if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            raise invalid_field("token_ids", f"{bad} is outside the vocabulary [0, {self.model.vocab_size})")
        prompt = from_proto(chat, where, allow_empty=True)
        self.parsing.check(prompt, where)
        return self.parsing.parse(prompt, token_ids, prompt_ids)

    async def unload_adapter(self, name: str) -> pb.AdapterStatus:
        """UnloadAdapter (and the vLLM dialect's /v1/unload_lora_adapter): no new request may name it; its versions
        are unloaded from every engine once the sequences on them finished."""
        from rollout_service.server.convert import adapter_to_proto

        adapter, drop = await self.weights.adapters.unload(name)      # recorded (a state_dir) before it is gone
        status = adapter_to_proto(adapter)
        if drop:
            await self.pool.unload_adapters(drop)
        return status

    def _on_adapter(self, checked: CheckedRequest, min_version: int) -> None:
        """Put every sequence of a request naming an adapter on the adapter version it resolves to (admission:
        NOT_FOUND / FAILED_PRECONDITION naming policy or policy_version)."""
        registry = self.pool.adapters
        if not registry.enabled:
            raise about_field(grpc.StatusCode.FAILED_PRECONDITION, "policy",
                              f"{checked.policy!r}: this server serves no LoRA adapters (engine.lora.max_adapters "
                              "is 0); leave policy empty for the base policy, or restart it with --max-adapters N")
        av = registry.resolve(checked.policy, checked.policy_version)
        if min_version > av.version:
            raise about_field(grpc.StatusCode.FAILED_PRECONDITION, "min_policy_version",
                              f"{min_version} but adapter {checked.policy!r} serves version {av.version}; push a "
                              "newer adapter first or lower min_policy_version", sep=" ")
        for group in checked.groups:
            for i, seq in enumerate(group):
                group[i] = msgspec.structs.replace(seq, lora_name=av.vllm_name, lora_id=av.lora_id,
                                                   lora_path=str(av.path), adapter_version=av.version)
