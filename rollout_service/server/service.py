"""The service layer: what both front doors call, the gRPC servicer (grpc_service.py) and the HTTP dialects
(compat/, through compat/gateway.py). It holds the pool, the model, the request limits, the weights and the
weight-transfer group, and admits a request the one way (check, then submit to the pool). Neither front door
calls the other."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from rollout_service.api import pb
from rollout_service.errors import ServiceError
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
                 transfer: WeightTransfer):
        self.pool = pool
        self.model = model
        self.limits = limits
        self.weights = weights
        self.transfer = transfer

    async def admit(self, request: pb.GenerateRequest) -> tuple[CheckedRequest, RequestRecord]:
        """Check a request and admit it to the pool (or find the record it retries): the one admission path,
        shared by Generate and the HTTP dialects. Raises ServiceError."""
        if any(p.text for p in request.prompts) or request.ByteSize() > HEAVY_REQUEST_BYTES:
            # tokenising text (chat templates) and hashing a large request take milliseconds to seconds:
            # not on the event loop. One thread: a Hugging Face tokenizer is not safe to share across threads.
            checked = await asyncio.get_running_loop().run_in_executor(
                TOKENIZER, check_generate, request, self.model, self.limits)
        else:
            checked = check_generate(request, self.model, self.limits)
        if request.min_policy_version > self.pool.policy_version:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"min_policy_version={request.min_policy_version} but the service serves "
                               f"policy version {self.pool.policy_version}; push newer weights first or "
                               "lower min_policy_version")
        return checked, self.pool.submit(checked.request_id, checked.fingerprint, checked.groups,
                                         session=checked.session_id, partials=checked.partials,
                                         return_partial=checked.return_partial)
