"""Routing replay (R3) on vLLM's V1 model runner: the experts each token was routed to, through vLLM's own
auxiliary-output connector.

vLLM 0.32 returns routed experts (`enable_return_routed_experts`, `CompletionOutput.routed_experts`
[tokens, layers, top_k]) through a data plane it ships whole: the scheduler's `AuxOutputSchedulerConnector` (which
rows each step must emit, the KV block hashes that key them), the worker's `AuxOutputWorkerConnector` (capture
hooks on every MoE router, a store of full blocks keyed by block hash so that prompt tokens served from the prefix
cache get the routes computed when they were cached, only the rows of accepted tokens: a rejected draft's rows are
dropped) and the front end's output processor. Only Model Runner V2 (GPU nodes, which needs Triton) drives the
worker side, and `VllmConfig` refuses the feature on any other runner.

Here, for the V1 runner (this CPU; `CPUModelRunner` subclasses it): `install()` drives the same worker connector
from `GPUModelRunner` — created after the KV cache (it needs the cache's block layout), `begin_step` before each
forward with the scheduler's metadata, one step's rows taken after the forward, and the accepted counts after
sampling — and sets `ModelRunnerOutput.aux_output_connector_output` as V2 does. `allow_v1_runner()` lifts the
config check for the V1 runner in the process that builds the engine's config (the front end). Everything
downstream (scheduler, output processor) is vLLM's own.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

log = logging.getLogger(__name__)
_STEP = "_rollout_aux_step"        # the step's rows between execute_model and sample_tokens


def install() -> bool:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_rollout_routed_experts", False):
        return True
    for cls in (GPUModelRunner, CPUModelRunner):         # the CPU runner overrides initialize_kv_cache
        if "initialize_kv_cache" in cls.__dict__:
            cls.initialize_kv_cache = _after_kv_cache(cls.__dict__["initialize_kv_cache"])
    GPUModelRunner.execute_model = _around_execute(GPUModelRunner.execute_model)
    GPUModelRunner.sample_tokens = _after_sample(GPUModelRunner.sample_tokens)
    GPUModelRunner._rollout_routed_experts = True
    return True


def allow_v1_runner() -> bool:
    """VllmConfig._verify_aux_output_compatibility refuses every runner but V2; keep its other checks (MoE model,
    prefix caching, no pipeline or context parallelism, ...) and let the V1 runner through, which install()
    drives. It also refuses the copy of the config a draft model is built with (runner "draft", a dense drafter:
    "only supports generate runners"), which stopped every MoE target with a draft model; routes are captured on
    the target only, so that copy is let through."""
    from vllm.config.vllm import VllmConfig

    if getattr(VllmConfig, "_rollout_aux_v1", False):
        return True
    check = VllmConfig._verify_aux_output_compatibility

    def verify(self) -> None:
        if self.aux_output_config.enabled and self.model_config.runner_type == "draft":
            return           # a draft model's copy of the config (DraftModelProposer): routes are the target's only
        check(self if self.use_v2_model_runner else _AsV2(self))

    VllmConfig._verify_aux_output_compatibility = verify
    VllmConfig._rollout_aux_v1 = True
    return True


class _AsV2:
    """A read-only view of a VllmConfig that says the V2 runner is in use (the check's only runner clause)."""

    use_v2_model_runner = True

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def _after_kv_cache(original):
    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, **kw):
        original(self, kv_cache_config, is_profiling, **kw)
        if is_profiling or not self.vllm_config.aux_output_config.enabled or getattr(self, "_rollout_aux", None):
            return
        from vllm.distributed.aux_output_connector.worker import get_aux_output_connector

        self._rollout_aux = get_aux_output_connector(self.model, self.vllm_config, self.kv_cache_config)
        log.info("routed experts: vLLM's auxiliary-output connector driven from the V1 model runner")
    return initialize_kv_cache


def _around_execute(original):
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        aux = getattr(self, "_rollout_aux", None)
        if aux is None:
            return original(self, scheduler_output, intermediate_tensors)
        aux.begin_step(scheduler_output.aux_output_connector_metadata)
        out = original(self, scheduler_output, intermediate_tensors)
        total = scheduler_output.total_num_scheduled_tokens
        if out is not None or total == 0 or aux._buffer is None:    # no forward, or sampled already
            setattr(self, _STEP, None)
            return out
        req_ids = list(self.input_batch.req_ids[:self.input_batch.num_reqs])
        computed = _computed_before(scheduler_output)
        counts = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        batch = SimpleNamespace(                      # the attributes prepare_output reads of V2's InputBatch
            req_ids=req_ids,
            query_start_loc_np=np.concatenate(([0], np.cumsum(counts))),
            num_computed_tokens_np=np.array([computed[r] for r in req_ids], dtype=np.int64))
        assert int(batch.query_start_loc_np[-1]) == total, "routed experts: batch layout is not the scheduler's"
        drafts = {r: len(scheduler_output.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids}
        setattr(self, _STEP, (aux.prepare_output(batch), drafts))
        return out
    return execute_model


def _after_sample(original):
    def sample_tokens(self, grammar_output):
        output = original(self, grammar_output)
        step = getattr(self, _STEP, None)
        if step is None:
            return output
        setattr(self, _STEP, None)
        pending, drafts = step
        if pending is None:
            return output
        sampled_by_req = {r: len(t) for r, t in zip(output.req_ids, output.sampled_token_ids)}
        sampled = np.array([sampled_by_req.get(r, 0) for r in pending.request_ids], dtype=np.int64)
        # rows of drafts the policy rejected: of d drafts verified, s - 1 were accepted (s tokens sampled)
        rejected = np.array([min(max(drafts[r] - (s - 1), 0), drafts[r]) if s else 0
                             for r, s in zip(pending.request_ids, sampled)], dtype=np.int64)
        pending.enqueue_cpu_copy(sampled, rejected)
        output.aux_output_connector_output = pending.process_output()
        return output
    return sample_tokens


def _computed_before(scheduler_output) -> dict[str, int]:
    """Tokens each scheduled request had computed before this step (the scheduler's count: prefix-cache hits
    included)."""
    out = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    out.update(zip(cached.req_ids, cached.num_computed_tokens))
    return out
