"""A real vLLM engine (AsyncLLM, its EngineCore in a child process) behind the Engine interface."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from rollout_service.config import OPEN_BATCH, EngineConfig, k_mode
from rollout_service.engine import lifeline
from rollout_service.engine import quantize
from rollout_service.engine.base import Engine, EngineState
from rollout_service.engine.cpu_env import (extra_environment, is_cpu_platform, prepare_cpu_environment,
                                            resolve_dtype)
from rollout_service.engine.types import Routes, SeqRequest, SeqResult, TokenDelta, route_spans

log = logging.getLogger(__name__)


PREPARE_POLL_S = 0.01           # how often a commit looks whether the worker has prepared the new weights


def speculative_config(sp) -> dict | None:
    """SpeculationConfig -> vLLM's speculative_config dict (None: no speculation)."""
    if sp.method == "none":
        return None
    out = {"method": sp.method, "num_speculative_tokens": sp.num_speculative_tokens}
    if sp.method in ("draft_model", "eagle3"):
        out["model"] = sp.model
    if sp.quantization in quantize.GPU_ONLY:          # vLLM's online quantization of the drafter (int8: its checkpoint)
        out["quantization"] = quantize.GPU_ONLY[sp.quantization]
    if sp.method in ("draft_model", "eagle3", "mtp"):
        out["draft_sample_method"] = sp.draft_sampling
    if sp.method == "ngram":
        out.update(prompt_lookup_min=sp.prompt_lookup_min, prompt_lookup_max=sp.prompt_lookup_max)
    if sp.method == "suffix":      # Arctic Inference's suffix trees (the arctic-inference package)
        out.update(suffix_decoding_max_spec_factor=sp.suffix_max_spec_factor,
                   suffix_decoding_min_token_prob=sp.suffix_min_token_prob)
    mode = k_mode(sp)
    if mode == "schedule":     # vLLM's dynamic speculative decoding: the scheduler picks k by batch size per step
        out["num_speculative_tokens_per_batch_size"] = [list(r) for r in sp.k_by_batch_size]
    elif mode == "auto":       # the same path, with the lookup replaced by the controller (speculation/k_scheduler.py)
        out["num_speculative_tokens_per_batch_size"] = [[1, OPEN_BATCH, sp.num_speculative_tokens]]
    return out


K_SCHEDULER = "rollout_service.speculation.k_scheduler.KControlledScheduler"


def check_supported(cfg: EngineConfig, moe: bool, head_size: int | None = None) -> None:
    """Refuse at start-up, naming the flag, what the engines here cannot serve: fp8 / mxfp8 and batch-invariant
    kernels where vLLM does not build them (this CPU), int8 for a mixture of experts (not built here), and an attention
    head size vLLM's CPU attention lacks (it started, said ready, and died at the first request, then again)."""
    from rollout_service.config import ConfigError

    cpu = is_cpu_platform()
    if cpu and head_size:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_size not in sizes:
            raise ConfigError(f"the model's attention head size is {head_size} (config.json head_dim, or hidden_size / "
                              f"num_attention_heads); vLLM's CPU attention supports {', '.join(map(str, sizes))}: "
                              "serve this model on GPU nodes, or choose one with a supported head size")
    for field, flag, method in (("engine.quantization", "--quantization", cfg.quantization),
                                ("engine.speculation.quantization", "--draft-quantization",
                                 cfg.speculation.quantization)):
        if method in quantize.GPU_ONLY and cpu:
            raise ConfigError(f"{field} ({flag}) {method} needs GPU nodes: vLLM 0.32 does not build its {method} "
                              "kernels for CPU (_C::static_scaled_fp8_quant is missing); on this CPU use int8 "
                              "(W8A8, oneDNN)")
    if cfg.quantization == "int8" and moe:
        raise ConfigError("engine.quantization (--quantization) int8 serves dense policies only: its checkpoint "
                          "quantizes linear layers, not a mixture of experts' fused experts; use fp8 on GPU nodes")
    if cfg.batch_invariant and cpu:
        raise ConfigError("engine.batch_invariant (--batch-invariant) needs GPU nodes: vLLM's batch-invariant kernels "
                          "(VLLM_BATCH_INVARIANT=1) are written in Triton, which vLLM's CPU build lacks. On this CPU "
                          "the default float32 kernels already gave bit-identical seeded samples alone, in a batch "
                          "and from the prefix cache (tests/integration/test_batch_invariance.py)")


def transfer_backend(choice: str) -> str:
    """engine.weight_transfer -> the vLLM weight-transfer backend: `auto` is gloo on CPU, nccl on GPUs."""
    if choice != "auto":
        return choice
    return "gloo" if is_cpu_platform() else "nccl"


class VllmEngine(Engine):
    """One vLLM AsyncLLM. The policy version is vLLM's weight version, so spans come back per sample."""

    def __init__(self, engine_id: str, model_path: str, cfg: EngineConfig):
        super().__init__(engine_id)
        self.model_path = model_path
        self.cfg = cfg
        self.llm = None
        self.served_path = model_path            # what vLLM loads: the int8 copy with engine.quantization = int8
        self.draft_path = cfg.speculation.model

    @property
    def captures_routes(self) -> bool:
        """Whether this engine captures routed experts: engine.routed_experts = auto on a mixture-of-experts model."""
        from rollout_service.model_info import MoeShape

        config = Path(self.model_path) / "config.json"
        if self.cfg.routed_experts == "off" or not config.is_file():
            return False
        return MoeShape.of(json.loads(config.read_text())) is not None

    def engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        extra = {}
        if is_cpu_platform():
            # vLLM bug on CPU: a seeded request whose prefill is split across steps (chunked prefill)
            # kills the engine: gpu_model_runner._bookkeeping_sync rewinds the request's generator with
            # `gen.set_offset(gen.get_offset() - 4)`, which only CUDA generators support ("CPU Generator
            # does not use offset"). Without chunked prefill no prefill is split; every prompt still fits
            # one step because the step budget is at least the context length.
            # Covered by tests/integration/test_generate.py::test_seeded_long_prompt_batch.
            # The KV cache in bytes: VLLM_CPU_KVCACHE_SPACE (which vLLM lets win where it is set) takes whole GiB
            # only, and an engine zero-fills all of it at start (1 GiB took 0.4-2.2 s on 2 cores: the kernel
            # compacts memory for the huge pages THP_MEM_ALLOC_ENABLE asks for), so a small model's tests size it
            # in fractions of a GiB.
            extra = dict(enable_chunked_prefill=False,
                         max_num_batched_tokens=max(self.cfg.max_model_len, 2048),
                         kv_cache_memory_bytes=int(self.cfg.kv_cache_gb * 2**30))
        if self.captures_routes:           # routing replay: vLLM's capture (engine/routed_experts.py on the V1 runner)
            extra.update(enable_return_routed_experts=True)
        lora = self.cfg.lora
        if lora.max_adapters:          # LoRA adapters as policies: every loaded version fits the worker's cache
            extra.update(enable_lora=True, max_lora_rank=lora.max_rank, max_loras=lora.per_batch(),
                         max_cpu_loras=max(lora.per_batch(), lora.max_adapters * (lora.versions_kept + 1)))
        if self.cfg.quantization in quantize.GPU_ONLY:     # vLLM quantizes the float checkpoint as it loads
            extra.update(quantization=quantize.GPU_ONLY[self.cfg.quantization])
        spec = speculative_config(self.cfg.speculation)
        if spec is not None and "model" in spec:
            spec["model"] = self.draft_path
        if spec is not None:
            extra.update(speculative_config=spec, per_request_spec_decode_metrics="summary")
            if k_mode(self.cfg.speculation) == "auto":
                extra.update(scheduler_cls=K_SCHEDULER)
        return AsyncEngineArgs(
            **extra,
            model=self.served_path,
            tokenizer=self.model_path,
            dtype=resolve_dtype(self.cfg.dtype),
            max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            enforce_eager=self.cfg.enforce_eager,
            seed=self.cfg.seed,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,        # only vLLM's check of a request: the service caps top_logprobs before admission
            disable_log_stats=True,
            worker_extension_cls="rollout_service.engine.worker_ext.RolloutWorkerExtension",
            weight_transfer_config={"backend": transfer_backend(self.cfg.weight_transfer)}
            if self.cfg.weight_transfer != "none" else None,
        )

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        if is_cpu_platform():
            prepare_cpu_environment()
        lifeline.mark_front_end()      # whatever process starts an engine (server, bench, check): it dies with it
        self.state = EngineState.STARTING
        sp = self.cfg.speculation
        # the served precision's checkpoint (int8: the float checkpoint quantized, written once and cached)
        self.served_path = await asyncio.to_thread(quantize.served_checkpoint, self.model_path, self.cfg.quantization)
        if sp.method == "draft_model" and sp.model:
            self.draft_path = await asyncio.to_thread(quantize.served_checkpoint, sp.model, sp.quantization)
        log.info("%s: starting vLLM on %s%s", self.id, self.model_path,
                 f" (served in {self.cfg.quantization}: {self.served_path})" if self.cfg.quantization != "none" else "")
        # Off the event loop: start-up blocks ~30 s (engine process, model load), and a restart must not
        # freeze the server (status, health, the other engines' streams). AsyncLLM starts its output
        # handler lazily on the loop that first uses it.
        env = {"VLLM_BATCH_INVARIANT": "1"} if self.cfg.batch_invariant else None
        with extra_environment(env):
            self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, self.engine_args())
        await self.llm.update_weight_version(str(self.policy_version))
        if self.draft_version:                       # a restart at a committed drafter: label the controller's data
            await self._spec_control("drafter", self.draft_version)
        if self.cfg.weight_reload == "shadow":       # so that even the first commit collects cheaply
            await self.llm.collective_rpc("rollout_freeze_startup_objects")
        self.patches = (await self.llm.collective_rpc("rollout_patch_report"))[0]
        for p in self.patches:
            log.info("%s: vLLM patch %s: %s%s", self.id, p["name"], p["state"],
                     f" ({p['reason']})" if p["reason"] else "")
        self.state = EngineState.READY
        log.info("%s: ready", self.id)

    def _sampling_params(self, req: SeqRequest):
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        return SamplingParams(
            n=1,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_tokens,
            stop=list(req.stop) or None,
            stop_token_ids=list(req.stop_token_ids) or None,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            detokenize=req.detokenize,
            # the sampled token's log-prob and the top-k, under the processed distribution (logprobs_mode) in
            # plain and speculative steps alike (vLLM's rejection sampler gathers them from the same logits)
            logprobs=req.top_logprobs,
            flat_logprobs=True,      # kept as flat lists (vLLM's FlatLogprobs): no dict and no Logprob per entry
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            routed_experts_prompt_start=req.routes_from,
            structured_outputs=StructuredOutputsParams(**json.loads(req.structured_outputs))
            if req.structured_outputs else None,
        )

    async def generate(self, req: SeqRequest, on_delta=None) -> SeqResult:
        llm = self.llm
        if llm is None:
            raise RuntimeError(f"{self.id} is not started")
        final = None
        stream = req.stream and on_delta is not None
        parts = _Parts() if req.stream else None
        rows = _RowStream(req) if stream and req.return_routed_experts else None
        lora = None
        if req.lora_id:
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(req.lora_name, req.lora_id, req.lora_path)
        try:
            async for out in llm.generate(
                {"prompt_token_ids": req.prompt_token_ids}, self._sampling_params(req), req.seq_id,
                lora_request=lora,
            ):
                if parts is None:
                    final = out
                    continue
                comp = out.outputs[0]
                start = parts.add(comp, req.top_logprobs)
                if stream and not out.finished and len(comp.token_ids):
                    spans = self._delta_spans(llm, req.seq_id, start, len(parts.token_ids))
                    delta = parts.delta(start, spans)
                    if rows is not None:
                        delta.routed_experts = rows.new(self._request_state(llm, req.seq_id), spans)
                    on_delta(delta)
                final = out
        except asyncio.CancelledError:
            # AsyncLLM.generate aborts on cancellation too; this makes sure the engine forgets it.
            if not llm.errored:
                await asyncio.shield(llm.abort(req.seq_id))
            raise
        except Exception:
            if llm.errored:
                self.state = EngineState.UNHEALTHY
                log.error("%s: vLLM engine died; marked unhealthy", self.id)
            raise
        if final is None:
            raise RuntimeError(f"{self.id} returned no output for {req.seq_id}")
        if parts is not None:
            result = parts.result(final.outputs[0], self.policy_version, self.draft_version)
        else:
            result = _to_result(final.outputs[0], self.policy_version, self.draft_version, req.top_logprobs)
        result.num_cached_tokens = int(final.num_cached_tokens or 0)     # vLLM's prefix-cache hit, in tokens
        if req.return_routed_experts:
            result.routed_experts = routes_of(final.outputs[0].routed_experts, req, result.version_spans)
        return result

    @staticmethod
    def _request_state(llm, seq_id: str):
        """vLLM's front-end state of a running request (output_processor's, keyed by its internal id)."""
        op = llm.output_processor
        internal = op.external_req_ids.get(seq_id) or [seq_id]
        return op.request_states.get(internal[-1])

    def _delta_spans(self, llm, seq_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """The policy versions that produced tokens [start, end) of a running sequence: vLLM's front end records
        the weight version of every step's output per request (output_processor's request state; the finished
        output carries the same as weight_versions). Falls back to this engine's label."""
        state = self._request_state(llm, seq_id)
        starts = list(getattr(state, "weight_version_starts", None) or [])
        try:
            spans = [(int(v), max(t, start)) for i, (v, t) in enumerate(starts)
                     if t < end and (i + 1 == len(starts) or starts[i + 1][1] > start)]
        except ValueError:                      # a version label that is not ours (not an integer)
            spans = []
        return spans or [(self.policy_version, start)]

    def alive(self) -> bool:
        return self.llm is not None and not self.llm.errored

    def death_reason(self) -> str:
        if self.llm is None:
            return "not started"
        return f"vLLM engine core died ({type(self.llm.dead_error).__name__})" if self.llm.errored else ""

    async def pause(self, mode: str) -> None:
        # clear_cache: KV computed under the old weights must not be reused; kept sequences are re-prefilled
        # under the new weights when they resume (vLLM preempts them).
        self.state = EngineState.PAUSED
        await self.llm.pause_generation(mode=mode, clear_cache=True)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.llm.reset_prefix_cache())

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self.state = EngineState.READY

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if not self.cfg.lora.max_adapters:
            raise RuntimeError(f"{self.id} was started without LoRA (engine.lora.max_adapters 0)")
        if not await self.llm.add_lora(LoRARequest(name, lora_id, path)):
            raise RuntimeError(f"{self.id}: vLLM did not load adapter {name}")

    async def remove_adapter(self, lora_id: int) -> None:
        await self.llm.remove_lora(lora_id)

    async def load_weights(self, path: str, target: str) -> None:
        await self.llm.collective_rpc("rollout_load_weights", args=(path, target))

    async def prepare_weights(self, paths: list[str], target: str) -> bool:
        if self.cfg.weight_reload == "in_place":
            return False
        result = await self._worker_job("rollout_prepare_weights", ([str(p) for p in paths], target),
                                        f"preparing {target} weights")
        self._log_prepared(target, result)
        return True

    async def init_transfer(self, init_info: dict) -> int:
        # vLLM's init_weight_transfer_engine, run in a worker thread: the rendezvous may wait for the trainer's
        # ranks up to the group's timeout, and generation goes on meanwhile
        await self._worker_job("rollout_transfer_init", (init_info,), "joining the weight-transfer group")
        return self.transfer_ranks()

    def transfer_ranks(self) -> int:
        return self.cfg.tensor_parallel_size

    async def close_transfer(self) -> None:
        if self.llm is not None and not self.llm.errored:
            await self.llm.collective_rpc("shutdown_weight_transfer_engine")

    async def prepare_transfer(self, update_info: dict, target: str, record_path: str, on_receiving) -> None:
        if self.cfg.weight_reload == "in_place":
            raise RuntimeError("weight transfers need engine.weight_reload = shadow (they load while generating)")
        result = await self._worker_job("rollout_transfer_prepare", (update_info, target, record_path),
                                        f"receiving {target} weights", on_receiving)
        self._log_prepared(target, result)

    def _log_prepared(self, target: str, result: dict) -> None:
        log.info("%s: prepared %s weights (%s)", self.id, target,
                 ", ".join(f"{k} {v:.3f} s" for k, v in result.get("phases_s", {}).items()))

    async def receive_transfer(self, update_info: dict, record_path: str, on_receiving) -> None:
        result = await self._worker_job("rollout_transfer_receive", (update_info, record_path),
                                        "receiving tensors over the weight-transfer group", on_receiving)
        log.info("%s: received %d tensors over the weight-transfer group (%s)", self.id, result.get("tensors", 0),
                 ", ".join(f"{k} {v:.3f} s" for k, v in result.get("phases_s", {}).items()))

    async def _worker_job(self, method: str, args: tuple, what: str, on_started=None) -> dict:
        """Run a worker_ext job that works in a thread of the worker: the RPC returns at once, so the engine core
        keeps stepping; the thread reports through a file (the workers are this process's children on the same
        machine, so they share its temp dir)."""
        done = Path(tempfile.gettempdir()) / f"rollout-prepared-{os.getpid()}-{self.id}-{time.monotonic_ns()}.json"
        await self.llm.collective_rpc(method, args=(*args, str(done)))
        if on_started is not None:
            on_started()
        try:
            while not done.exists():
                if self.llm.errored:
                    raise RuntimeError(f"{self.id}: {self.death_reason()} while {what}")
                await asyncio.sleep(PREPARE_POLL_S)
            result = json.loads(done.read_text())
        finally:
            done.unlink(missing_ok=True)
        if "error" in result:
            raise RuntimeError(f"{what} failed in the worker: {result['error']}")
        return result

    async def swap_weights(self, target: str) -> None:
        await self.llm.collective_rpc("rollout_swap_weights", args=(target,))

    async def discard_weights(self) -> None:
        await self.llm.collective_rpc("rollout_discard_weights")

    async def set_versions(self, policy_version: int, draft_version: int) -> None:
        await self.llm.update_weight_version(str(policy_version))
        if draft_version != self.draft_version:
            await self._spec_control("drafter", draft_version)
        self.policy_version, self.draft_version = policy_version, draft_version

    async def _spec_control(self, command: str, arg: int = 0):
        if self.llm is None or k_mode(self.cfg.speculation) != "auto":
            return None
        return await self.llm.engine_core.call_utility_async("rollout_spec_control", command, arg)

    async def k_control_snapshot(self) -> dict | None:
        return await self._spec_control("snapshot")

    async def k_control_steps(self) -> list[list] | None:
        """The controlled scheduler's last steps: [finished at (time.perf_counter, the same clock here), batch, k,
        drafter off, seconds, steady] (None without the controller)."""
        return await self._spec_control("steps")

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
            await _release_engine_memory()
        self.state = EngineState.STOPPED


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):          # not glibc: nothing to trim
        pass


async def _release_engine_memory() -> None:
    """After an AsyncLLM's shutdown: free what is left of it now and hand the freed heap back to the OS. Without this
    every engine restart grew the front end's RSS by 30-45 MB for good (5 engine-core kills: 797 -> 991 MB) although no
    object of the old engine survived (its AsyncLLM and ZMQ context were gone, tracemalloc flat): glibc malloc kept the
    freed pages of each engine's start-up and teardown (malloc_trim gave back 25-120 MB each time). The collection
    (0.01-0.04 s, once per restart) frees an old engine caught in reference cycles before the trim instead of at some
    later full collection (its ZMQ context's 3 threads and ~9 fds outlived it until then); malloc_trim releases the
    GIL (ctypes), so it runs off the loop. With it the same kills left the front end at 845-864 MB, flat."""
    t0 = time.perf_counter()
    found = gc.collect()
    held = time.perf_counter() - t0
    await asyncio.to_thread(_malloc_trim)
    log.info("engine memory released: %d objects collected in %.2f s, heap trimmed in %.2f s", found, held,
             time.perf_counter() - t0 - held)


def routes_of(rows, req: SeqRequest, token_spans: list[tuple[int, int]], first_row: int | None = None) -> Routes:
    """vLLM's routed-experts rows ([rows, layers, top_k], uint8 or uint16; None: none this time) -> Routes from row
    `first_row` (default: the request's routes_from), with the versions that routed them."""
    import numpy as np

    first = req.routes_from if first_row is None else first_row
    if rows is None:
        raise RuntimeError(f"{req.seq_id}: the engine returned no routed experts (is it capturing them? "
                           "engine.routed_experts)")
    rows = np.ascontiguousarray(rows)
    dtype = "uint8" if rows.dtype == np.uint8 else "uint16"
    return Routes(first_row=first, rows=rows.shape[0], layers=rows.shape[1], top_k=rows.shape[2], dtype=dtype,
                  data=rows.astype("<u1" if dtype == "uint8" else "<u2", copy=False).tobytes(),
                  version_spans=route_spans(token_spans, len(req.prompt_token_ids), first))


class _RowStream:
    """The routed-experts rows of a streamed request that no delta carried yet (vLLM's front end keeps each step's
    rows in the request's state until it finishes)."""

    def __init__(self, req: SeqRequest):
        self.req = req
        self.chunks = 0                      # chunks of the request state already sent
        self.next_row = req.routes_from

    def new(self, state, spans: list[tuple[int, int]]) -> Routes | None:
        import numpy as np

        chunks = getattr(state, "routed_experts_chunks", None) or []
        fresh = chunks[self.chunks:]
        if not fresh:
            return None
        self.chunks = len(chunks)
        out = routes_of(np.concatenate(fresh, axis=0), self.req, spans, self.next_row)
        self.next_row = out.end
        return out


def _logprobs(comp, token_ids: list[int], k: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """A CompletionOutput's log-probs: the sampled token's at every position and, with k > 0, the k most likely
    tokens' (vLLM gives the sampled token and the top k per position, each with its rank)."""
    flat = comp.logprobs
    if hasattr(flat, "start_indices"):    # FlatLogprobs: per position the sampled token, then ranks 1..k in order
        starts, values = flat.start_indices[:len(token_ids)], flat.logprobs
        if not k:
            return [values[i] for i in starts], [], []
        ids = flat.token_ids
        return ([values[i] for i in starts], [ids[i + 1:i + 1 + k] for i in starts],
                [values[i + 1:i + 1 + k] for i in starts])
    logprobs, top_ids, top_lps = [], [], []
    for pos, tok in enumerate(token_ids):
        entry = comp.logprobs[pos]
        logprobs.append(float(entry[tok].logprob))
        if k:
            best = sorted(entry.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]
            top_ids.append([t for t, _ in best])
            top_lps.append([float(lp.logprob) for _, lp in best])
    return logprobs, top_ids, top_lps


class _Parts:
    """A streamed sequence's deltas (vLLM's DELTA outputs) gathered into the whole sequence."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_token_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []
        self.text = ""

    def add(self, comp, k: int) -> int:
        """Append one delta; returns the index of its first token."""
        start = len(self.token_ids)
        ids = list(comp.token_ids)
        lps, top_ids, top_lps = _logprobs(comp, ids, k)
        self.token_ids += ids
        self.logprobs += lps
        self.top_token_ids += top_ids
        self.top_logprobs += top_lps
        self.text += comp.text or ""
        return start

    def delta(self, start: int, spans: list[tuple[int, int]]) -> TokenDelta:
        return TokenDelta(start=start, token_ids=self.token_ids[start:], logprobs=self.logprobs[start:],
                          version_spans=spans, top_token_ids=self.top_token_ids[start:],
                          top_logprobs=self.top_logprobs[start:])

    def result(self, last, policy_version: int, draft_version: int) -> SeqResult:
        """The whole sequence: the tokens gathered, with the last delta's finish, spans and speculation counts."""
        out = _to_result(last, policy_version, draft_version, 0, whole=False)
        out.token_ids, out.logprobs, out.text = self.token_ids, self.logprobs, self.text
        out.top_token_ids, out.top_logprobs = self.top_token_ids, self.top_logprobs
        return out


def _to_result(comp, policy_version: int, draft_version: int, k: int = 0, whole: bool = True) -> SeqResult:
    """vLLM CompletionOutput -> SeqResult (whole=False: only its finish, spans and counts; the caller sets the
    tokens)."""
    token_ids = list(comp.token_ids) if whole else []
    logprobs, top_ids, top_lps = _logprobs(comp, token_ids, k)
    spans = [(int(s.version), int(s.start)) for s in (comp.weight_versions or [])]
    if not spans:
        spans = [(policy_version, 0)]
    drafted = accepted = steps = 0
    per_pos: list[int] = []
    if comp.spec_decode_metrics is not None:
        m = comp.spec_decode_metrics   # histogram[j] = verify steps that accepted exactly j drafts
        drafted = int(m.num_draft_tokens)
        accepted = sum(j * c for j, c in enumerate(m.histogram))
        steps = sum(m.histogram)
        per_pos = [sum(m.histogram[j] for j in range(i + 1, len(m.histogram))) for i in range(len(m.histogram) - 1)]
    finish = comp.finish_reason or "abort"
    return SeqResult(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason={"stop": "stop", "length": "length"}.get(finish, "abort"),
        stop_string=comp.stop_reason if isinstance(comp.stop_reason, str) else "",
        text=comp.text or "",
        policy_version=spans[0][0],
        version_spans=spans,
        draft_version=draft_version,
        num_drafted=drafted,
        num_accepted=accepted,
        spec_steps=steps,
        accepted_per_pos=per_pos,
        top_token_ids=top_ids,
        top_logprobs=top_lps,
    )
