"""The gRPC servicer: thin. It checks, hands work to the pool, and streams what the pool produces."""
from __future__ import annotations

import asyncio
import logging

import grpc

from rollout_service.api import pb, pb_grpc
from rollout_service.config import SpeculationConfig, k_mode
from rollout_service.errors import ServiceError, invalid, invalid_field
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.requests import IndexedDelta, RequestRecord
from rollout_service.pool.scaling import Scaler
from rollout_service.server.auth import Credentials, caller_id, check_scope, tenant_of
from rollout_service.server.service import TOKENIZER, RolloutService
from rollout_service.server.convert import (delta_to_proto, group_to_proto, header_from_proto,
                                            message_to_proto, metas_from_proto, push_items, push_result_to_proto,
                                            sample_to_proto, status_to_proto, target_and_mode)
from rollout_service.validation import CheckedRequest, Limits
from rollout_service.weights.service import WeightService
from rollout_service.weights.transfer import WeightTransfer

log = logging.getLogger(__name__)


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(self, pool: EnginePool, model: ModelInfo, limits: Limits, weights: WeightService,
                 speculation: SpeculationConfig | None = None, scaler: Scaler | None = None, *,
                 max_streams_per_client: int = 64, creds: Credentials | None = None,
                 transfer: WeightTransfer | None = None, parsing=None):
        self.speculation = speculation or SpeculationConfig()
        self.precision: dict = {}          # Status.quantization (engine/quantize.py describe); set by the server
        self.scaler = scaler
        self.max_streams_per_client = max_streams_per_client
        self.creds = creds
        self.streams: dict[str, int] = {}       # open Generate streams per caller_id
        self._warned: set[str] = set()
        self.pool = pool
        self.model = model
        self.limits = limits
        self.weights = weights
        self.transfer = transfer or WeightTransfer(weights, "none", 120.0)
        # what the HTTP dialects call
        self.service = RolloutService(pool, model, limits, weights, self.transfer, parsing)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        caller = caller_id(context, self.creds)
        if self.streams.get(caller, 0) >= self.max_streams_per_client:
            self.pool.telemetry.m_requests.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"max_streams_per_client={self.max_streams_per_client} Generate streams are already "
                                f"open for this client ({caller}); wait for one to finish or batch more prompts "
                                "into one request")
        self.streams[caller] = self.streams.get(caller, 0) + 1
        try:
            async for sample in self._generate(request, context):
                yield sample
        finally:
            self.streams[caller] -= 1
            if not self.streams[caller]:
                del self.streams[caller]

    async def admit(self, request: pb.GenerateRequest, tenant=None) -> tuple[CheckedRequest, RequestRecord]:
        """The service layer's admission (server/service.py), as the HTTP dialects call it too."""
        return await self.service.admit(request, tenant)

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        code = grpc.StatusCode.OK
        try:
            checked, record = await self.admit(request, tenant_of(context, self.creds))
        except ServiceError as e:
            self.pool.telemetry.m_requests.labels(e.code.name).inc()
            await context.abort(e.code, e.message)
        self.pool.attach(record)
        sent_prompt: set[int] = set()
        try:
            async for item in record.read(deltas=request.stream_tokens):
                p = item.prompt_index
                if isinstance(item, IndexedDelta):
                    msg = delta_to_proto(item, len(checked.prompt_token_ids[p]))
                    msg.policy = checked.policy
                    yield msg
                    continue
                send_prompt = p in checked.text_prompts and p not in sent_prompt
                sent_prompt.add(p)
                if request.return_text and checked.partials[p]:      # the engine decoded the new part only
                    item.result.text = await asyncio.get_running_loop().run_in_executor(
                        TOKENIZER, self.model.decode, item.result.token_ids)
                msg = sample_to_proto(item, checked.prompt_token_ids[p], send_prompt, request.return_text)
                msg.policy = checked.policy
                if checked.chats and checked.chats[p] is not None:     # read by the tool and reasoning parsers
                    message = await asyncio.get_running_loop().run_in_executor(
                        TOKENIZER, self.service.parsing.parse, checked.chats[p], item.result.token_ids,
                        checked.prompt_token_ids[p])
                    msg.message.CopyFrom(message_to_proto(message))
                yield msg
        except ServiceError as e:
            code = e.code
            await context.abort(e.code, e.message)
        except BaseException:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.pool.detach(record)
            self.pool.telemetry.m_requests.labels(code.name).inc()

    async def Render(self, request: pb.RenderRequest, context: grpc.aio.ServicerContext) -> pb.RenderResult:
        check_scope(tenant_of(context, self.creds), None, "", "sample")
        try:
            ids, num_prefix, text = await asyncio.get_running_loop().run_in_executor(
                TOKENIZER, self.service.render, request.chat, request.return_text)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        return pb.RenderResult(token_ids=ids, num_prefix_tokens=num_prefix, text=text)

    async def Parse(self, request: pb.ParseRequest, context: grpc.aio.ServicerContext) -> pb.AssistantMessage:
        check_scope(tenant_of(context, self.creds), None, "", "sample")
        try:
            message = await asyncio.get_running_loop().run_in_executor(
                TOKENIZER, self.service.parse, list(request.token_ids), request.chat, list(request.prompt_token_ids))
        except ServiceError as e:
            await context.abort(e.code, e.message)
        return message_to_proto(message)

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.Status:
        await self.pool.refresh_k_control(0.5)          # the k controller's state as of now, not of the last second
        return self.status(tenant_of(context, self.creds))

    def routes_capture(self) -> str:
        """How routed experts are captured: vLLM's own capture, driven by this project's V1-runner patch where vLLM
        drives it only on Model Runner V2 (engine/routed_experts.py); "" when they are not captured."""
        if not self.limits.routed_experts:
            return ""
        patched = any(p["name"] == "v1_routed_experts" and p["state"] == "applied" for p in self.pool.patch_report())
        return "vllm_v1_patch" if patched else "vllm"

    def status(self, tenant=None) -> pb.Status:
        """The service's state; a tenant's (auth.Tenant) view shows only its own adapters and its own entry."""
        sp = self.speculation
        k = sp.num_speculative_tokens if sp.method != "none" else 0
        status = status_to_proto(self.pool, self.model.path, self.model.vocab_size, self.model.max_model_len,
                                 sp.method, k, sp.draft_cost, k_mode(sp), self.model.moe, self.routes_capture())
        if self.precision:
            status.quantization.CopyFrom(pb.Quantization(**self.precision))
        if self.transfer.group is not None:
            status.weight_transfer.CopyFrom(group_to_proto(self.transfer.group))
        elif self.transfer.last_error:             # why the last group closed (a trainer gone, a push failed)
            status.warnings.append("weight transfer: " + "".join(map(str, self.transfer.last_error)) +
                                   "; InitWeightTransfer sets a group up again")
        for _, t in (self.creds.tenants if self.creds else ()):
            if tenant is not None and t.name != tenant.name:
                continue
            status.tenants.add(name=t.name, policies=list(t.policies), admitted_sequences=self.pool.tenant_load[t.name],
                               max_sequences=t.max_sequences or self.pool.max_queue,
                               waiting_sequences=self.pool.fair.waiting_of(t.name) if self.pool.fair else 0,
                               samples_total=self.pool.tenant_samples[t.name])
        if tenant is not None:                     # other tenants' adapter names are theirs
            mine = [a for a in status.adapters if tenant.owns(a.name)]
            del status.adapters[:]
            status.adapters.extend(mine)
        for w in status.warnings:
            if w not in self._warned:
                self._warned.add(w)
                log.warning("%s", w)
        return status

    # ---- control plane ---------------------------------------------------------------------------
    async def ScaleEngines(self, request: pb.ScaleRequest, context) -> pb.Status:
        try:
            if self.scaler is None:
                raise ServiceError(grpc.StatusCode.UNIMPLEMENTED, "this server cannot scale its engine pool")
            await self.scaler.scale(request.engines)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        return self.status()

    async def PushWeights(self, request_iterator, context) -> pb.PushResult:
        return await self._push(request_iterator, context, rpc="PushWeights")

    async def UpdateDraft(self, request_iterator, context) -> pb.PushResult:
        return await self._push(request_iterator, context, rpc="UpdateDraft")

    async def _push(self, request_iterator, context, rpc: str) -> pb.PushResult:
        try:
            stream = request_iterator.__aiter__()
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                raise invalid(f"{rpc}: empty stream; send a header, then tensor chunks") from None
            if first.WhichOneof("item") != "header":
                raise invalid(f"{rpc}: the first message must carry the header")
            header = header_from_proto(first.header, rpc)
            tenant = tenant_of(context, self.creds)
            if tenant is not None:
                if header.target != "adapter":
                    raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                                       f"{rpc}: tenant {tenant.name!r} pushes only its adapters (TARGET_ADAPTER); the "
                                       "base policy and the drafter need the admin token")
                check_scope(tenant, None, header.adapter, "push", "header.adapter")

            out = await self.weights.push(header, push_items(stream, rpc), tenant=tenant.name if tenant else "")
        except ServiceError as e:
            self.pool.telemetry.push_failed("stream")
            await context.abort(e.code, e.message)
        self._committed("stream", out)
        return push_result_to_proto(out)

    def _committed(self, path: str, out) -> None:
        self.pool.telemetry.push_committed(path, out.target, out.num_bytes, out.total_s, out.pause_s)

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context) -> pb.PushResult:
        try:
            target, mode = target_and_mode(request.target, request.in_flight, "LoadWeights: request")
            if target != "adapter" and request.adapter:
                raise invalid_field("adapter", "is for TARGET_ADAPTER loads only", sep=" ", rpc="LoadWeights")
            tenant = tenant_of(context, self.creds)
            if tenant is not None and target != "adapter":
                raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"LoadWeights: tenant {tenant.name!r} loads only its adapters (TARGET_ADAPTER)")
            check_scope(tenant, None, request.adapter, "load", "adapter")
            out = await self.weights.load(request.path, request.version, target, mode, request.partial,
                                          timeout=context.time_remaining(), adapter=request.adapter,
                                          tenant=tenant.name if tenant else "", base_version=request.base_version)
        except ServiceError as e:
            self.pool.telemetry.push_failed("path")
            await context.abort(e.code, e.message)
        self._committed("path", out)
        return push_result_to_proto(out)

    # ---- weights over a collective group (weights/transfer.py) -------------------------------------
    async def InitWeightTransfer(self, request: pb.WeightTransferInit, context):
        try:
            async for group in self.transfer.init(request.backend, request.master_address, request.master_port,
                                                  request.trainer_ranks, request.timeout_s,
                                                  caller=context.peer() or ""):
                yield group_to_proto(group)
        except ServiceError as e:
            await context.abort(e.code, e.message)

    async def TransferWeights(self, request: pb.TransferRequest, context):
        try:
            target, mode = target_and_mode(request.target, request.in_flight, "TransferWeights: request")
            async for item in self.transfer.push(request.version, target, mode, request.partial,
                                                 metas_from_proto(request.tensors), request.group_id,
                                                 adapter=request.adapter, adapter_config=request.adapter_config):
                if isinstance(item, tuple):
                    yield pb.TransferProgress(ready=pb.TransferReady(total_bytes=item[1]))
                else:
                    self._committed("transfer", item)
                    yield pb.TransferProgress(result=push_result_to_proto(item))
        except ServiceError as e:
            self.pool.telemetry.push_failed("transfer")
            await context.abort(e.code, e.message)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.AdapterStatus:
        try:
            check_scope(tenant_of(context, self.creds), None, request.name, "unload", "name")
            adapter = await self.service.unload_adapter(request.name)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        return adapter

    async def CloseWeightTransfer(self, request: pb.CloseWeightTransferRequest, context) -> pb.WeightTransferGroup:
        try:
            group = await self.transfer.close()
        except ServiceError as e:
            await context.abort(e.code, e.message)
        return group_to_proto(group) if group is not None else pb.WeightTransferGroup()
