"""The gRPC servicer: thin. It checks, hands work to the pool, and streams what the pool produces."""
from __future__ import annotations

import logging

import grpc

from rollout_service.api import pb, pb_grpc
from rollout_service.errors import ServiceError
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.server.convert import sample_to_proto, status_to_proto
from rollout_service.validation import Limits, check_generate

log = logging.getLogger(__name__)


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(self, pool: EnginePool, model: ModelInfo, limits: Limits):
        self.pool = pool
        self.model = model
        self.limits = limits

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        code = grpc.StatusCode.OK
        try:
            checked = check_generate(request, self.model, self.limits)
            if request.min_policy_version > self.pool.policy_version:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"min_policy_version={request.min_policy_version} but the service serves "
                                   f"policy version {self.pool.policy_version}; push newer weights first or "
                                   "lower min_policy_version")
            record = self.pool.submit(checked.request_id, checked.fingerprint, checked.groups)
        except ServiceError as e:
            self.pool.telemetry.m_requests.labels(e.code.name).inc()
            await context.abort(e.code, e.message)
        self.pool.attach(record)
        sent_prompt: set[int] = set()
        try:
            async for item in record.read():
                p = item.prompt_index
                send_prompt = p in checked.text_prompts and p not in sent_prompt
                sent_prompt.add(p)
                yield sample_to_proto(item, checked.prompt_token_ids[p], send_prompt, request.return_text)
        except ServiceError as e:
            code = e.code
            await context.abort(e.code, e.message)
        except BaseException:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.pool.detach(record)
            self.pool.telemetry.m_requests.labels(code.name).inc()

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.Status:
        return self.status()

    def status(self) -> pb.Status:
        return status_to_proto(self.pool, self.model.path, self.model.vocab_size, self.model.max_model_len)

    async def _not_yet(self, context, what: str):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{what} is not implemented by this server build yet (see issue: weight pushes)")

    async def PushWeights(self, request_iterator, context):
        await self._not_yet(context, "PushWeights")

    async def UpdateDraft(self, request_iterator, context):
        await self._not_yet(context, "UpdateDraft")

    async def LoadWeights(self, request, context):
        await self._not_yet(context, "LoadWeights")
