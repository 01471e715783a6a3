"""Assemble and run the service: engines -> pool -> gRPC servicer (+ health, reflection) and HTTP port.

Shutdown (SIGTERM/SIGINT): stop admitting, fail in-flight streams with UNAVAILABLE, stop the gRPC and
HTTP servers within the grace period, then shut the engines down (their child processes exit).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Callable

import grpc
import uvicorn
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from rollout_service.api import pb
from rollout_service.config import ConfigError, ServerConfig
from rollout_service.engine import forkserver, lifeline
from rollout_service.engine.base import Engine
from rollout_service.engine.quantize import describe
from rollout_service.chat.parse import Parsing
from rollout_service.model_info import ModelInfo
from rollout_service.pool.pool import EnginePool
from rollout_service.pool.scaling import Scaler
from rollout_service.pool.supervisor import Supervisor
from rollout_service.server.auth import AuthInterceptor, load_credentials, server_credentials
from rollout_service.server.decoding import add_servicer
from rollout_service.server.grpc_service import RolloutServicer
from rollout_service.server.health import HealthServicer
from rollout_service.server.http_app import build_http_app
from rollout_service.server.loop_watchdog import LoopWatchdog, freeze_startup_heap
from rollout_service.validation import Limits
from rollout_service.weights.service import WeightService
from rollout_service.weights.transfer import WeightTransfer
from rollout_service.scratch import remove_scratch_root, sweep_stale_roots

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name


def engine_factory(cfg: ServerConfig, model_path: str) -> Callable[[str], Engine]:
    """engine id -> a new real vLLM engine: in this process, or a Ray actor when `ray.address` is set."""
    if cfg.ray.address:
        from rollout_service.engine.ray_engine import RayEngine, connect

        connect(cfg.ray.address)
        return lambda engine_id: RayEngine(engine_id, model_path, cfg.engine, cpus=cfg.ray.cpus_per_engine,
                                           gpus=cfg.ray.gpus_per_engine)
    from rollout_service.engine.vllm_engine import VllmEngine

    return lambda engine_id: VllmEngine(engine_id, model_path, cfg.engine)


def serving_dtype(cfg: ServerConfig, model_path: str) -> str:
    """The dtype the engines compute in (what "auto" resolves to), for weight-push validation."""
    import json
    from pathlib import Path

    dtype = cfg.engine.dtype
    if dtype == "auto":
        try:
            from rollout_service.engine.cpu_env import resolve_dtype

            dtype = resolve_dtype(dtype)
        except ImportError:       # no vLLM (unit tests with the fake engine)
            pass
    if dtype == "auto":
        config = json.loads((Path(model_path) / "config.json").read_text())
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return dtype


def transfer_backend_of(cfg: ServerConfig) -> str:
    """The engines' weight-transfer backend (engine.weight_transfer, `auto` resolved by device)."""
    if cfg.engine.weight_transfer == "none":
        return "none"
    try:
        from rollout_service.engine.vllm_engine import transfer_backend
    except ImportError:             # no vLLM (unit tests with the fake engine): the CPU's backend
        return "gloo" if cfg.engine.weight_transfer == "auto" else cfg.engine.weight_transfer
    return transfer_backend(cfg.engine.weight_transfer)


def weights_roots(cfg: ServerConfig) -> list[str]:
    """Where LoadWeights may read: security.weights_roots, else the service's cache directory."""
    from rollout_service.models import cache_dir

    return list(cfg.security.weights_roots) or [str(cache_dir())]


def chat_parsing(cfg: ServerConfig, model: ModelInfo) -> Parsing:
    """The chat parsers the config names (ConfigError naming the flag where vLLM has no such parser, or the model's
    tokenizer lacks what it needs)."""
    try:
        return Parsing.configured(cfg.chat.tool_call_parser, cfg.chat.reasoning_parser, model.tokenizer,
                                  cfg.chat.enable_auto_tool_choice)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class RolloutServer:
    def __init__(self, cfg: ServerConfig, model: ModelInfo, factory: Callable[[str], Engine]):
        self.cfg = cfg
        engines = [factory(f"engine-{i}") for i in range(cfg.engines)]
        sp = cfg.engine.speculation
        drafter = sp.model if sp.method in ("draft_model", "eagle3") else None
        self.pool = EnginePool(engines, max_queue=cfg.max_queue, idempotency_ttl_s=cfg.idempotency_ttl_s,
                               checkpoints={"policy": model.path, "drafter": drafter},
                               max_sessions=cfg.sessions.max_sessions,
                               session_max_imbalance=cfg.sessions.max_imbalance, state_dir=cfg.state_dir,
                               lora=cfg.engine.lora,
                               fair_slots=cfg.engine.max_num_seqs if cfg.security.tenants else 0)
        quantized = frozenset(t for t, q in (("policy", cfg.engine.quantization), ("drafter", sp.quantization))
                              if q != "none")
        self.weights = WeightService.create(self.pool, serving_dtype(cfg, model.path),
                                            weights_roots=weights_roots(cfg), quantized=quantized)
        self.creds = load_credentials(cfg.security, cfg.host)
        limits = Limits(cfg.max_prompts_per_request, cfg.max_samples_per_prompt, cfg.max_new_tokens,
                        cfg.max_top_logprobs,
                        routed_experts=model.moe is not None and cfg.engine.routed_experts == "auto",
                        speculation=cfg.engine.speculation.method)
        self.scaler = Scaler(self.pool, factory)
        self.transfer = WeightTransfer.from_config(self.weights, transfer_backend_of(cfg), cfg)
        self.servicer = RolloutServicer(self.pool, model, limits, self.weights, sp, self.scaler,
                                        max_streams_per_client=cfg.max_streams_per_client, creds=self.creds,
                                        transfer=self.transfer, parsing=chat_parsing(cfg, model))
        self.servicer.precision = describe(cfg.engine.quantization, serving_dtype(cfg, model.path),
                                           sp.quantization if drafter and sp.method == "draft_model" else "",
                                           cfg.engine.batch_invariant)
        self.pool.telemetry.served_precision(self.servicer.precision)
        self.health = HealthServicer(("", SERVICE_NAME))
        limit = cfg.max_message_mb * 1024 * 1024
        # gRPC's receive cap sits well above max_message_mb (and above the client's 4 MiB push chunks) so
        # that decoding.py sees an oversized request and answers with a message naming the setting.
        hard_cap = max(2 * limit + (1 << 20), 16 << 20)
        self.grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", hard_cap),
                                             ("grpc.max_send_message_length", limit)],
                                    interceptors=[AuthInterceptor(self.creds)] if self.creds else None)
        add_servicer(self.servicer, self.grpc, max_message_bytes=limit)
        add_servicer(self.health, self.grpc, service=health_pb2.DESCRIPTOR.services_by_name["Health"])
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.grpc)
        tls = server_credentials(cfg.security)
        address = f"{cfg.host}:{cfg.grpc_port}"
        self.grpc_port = self.grpc.add_secure_port(address, tls) if tls else self.grpc.add_insecure_port(address)
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC to {cfg.host}:{cfg.grpc_port} (port in use?)")
        # Bind the HTTP port now, like gRPC's: uvicorn would bind only once the event loop runs its task,
        # after engine start-up (which blocks the loop and opens vLLM's own sockets on free ports).
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP (proto 0 does not),
        # and without it the second write of a response on a kept-alive connection waited for the client's delayed
        # ACK: a turn sent right after the last one on the same connection got its first token ~30 ms late (46 vs 15
        # ms, bench/agentic.py; uvloop, which `vllm serve` runs on, always sets it)
        self.http_socket = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM,
                                         socket.IPPROTO_TCP)
        self.http_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.http_socket.bind((cfg.host, cfg.http_port))
        except OSError as e:
            raise OSError(f"cannot bind HTTP to {cfg.host}:{cfg.http_port}: {e}") from e
        sec = cfg.security
        ssl = dict(ssl_certfile=sec.tls_cert, ssl_keyfile=sec.tls_key) if sec.tls_cert else {}
        if sec.tls_client_ca:
            import ssl as _ssl

            ssl.update(ssl_ca_certs=sec.tls_client_ca, ssl_cert_reqs=_ssl.CERT_REQUIRED)
        app = build_http_app(self.servicer, self.creds, cfg.sessions.key_from, cfg.return_tokens_as_token_ids)
        self.http = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.http_port, log_level="warning",
                                                  lifespan="off", **ssl))
        self._stop = asyncio.Event()
        self.supervisor: Supervisor | None = None
        self._watchdog_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind ports first (health says NOT_SERVING), then start engines, then report SERVING."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        self._http_task = asyncio.create_task(self.http.serve(sockets=[self.http_socket]))
        log.info("gRPC on %s:%d, HTTP on %s:%d (%s, %s); starting %d engine(s)", self.cfg.host, self.grpc_port,
                 self.cfg.host, self.cfg.http_port, "TLS" if self.cfg.security.tls_cert else "plaintext",
                 "bearer tokens" if self.creds else "no authentication", len(self.pool.engines))
        await self.pool.start()
        self.supervisor = Supervisor(self.pool, self.pool.restart_at_committed)
        self._supervisor_task = asyncio.create_task(self.supervisor.run())
        log.info("start-up heap frozen out of the garbage collector (%.2f s)", freeze_startup_heap())
        self.watchdog = LoopWatchdog(self.pool.telemetry.registry)     # lag on /metrics; warns, naming the code
        self._watchdog_task = asyncio.create_task(self.watchdog.run())
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        # the served weights' fingerprints (Status.policy_fingerprint): the checkpoint is hashed once, in a thread
        self._fingerprint_task = asyncio.create_task(asyncio.to_thread(
            lambda: [self.pool.committed.content_fingerprint(t) for t in ("policy", "drafter")]))
        log.info("serving %s (policy version %d); LoadWeights reads only below %s", self.servicer.model.path,
                 self.pool.policy_version, ", ".join(str(r) for r in self.weights.roots))
        if not self.pool.committed.durable:
            log.warning("no state_dir: commits are not kept across a restart; a restarted server serves its "
                        "model's version 0%s (set --state-dir on a volume to keep them)",
                        " and no LoRA adapter" if self.pool.adapters.enabled else "")

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_and_stop(self) -> None:
        await self._stop.wait()
        log.info("shutting down: failing in-flight requests with UNAVAILABLE, stopping engines")
        await self.health.enter_graceful_shutdown()
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        if self.supervisor is not None:
            self._supervisor_task.cancel()
            await self.supervisor.stop()
        await self.pool.shutdown()
        await self.grpc.stop(self.cfg.shutdown_grace_s)
        self.http.should_exit = True
        await self._http_task
        await asyncio.to_thread(remove_scratch_root)
        log.info("stopped")


def fit_context(cfg: ServerConfig, model: ModelInfo) -> str | None:
    """Serve at most the model's context, as `vllm serve` does without --max-model-len: asked for more (the default
    2048 on a 1024-token model), vLLM stops with a pydantic traceback; here a warning names the flag and both
    lengths (returned too)."""
    if model.max_model_len >= cfg.engine.max_model_len:
        return None
    said = (f"engine.max_model_len (--max-model-len) {cfg.engine.max_model_len} is above the model's context, "
            f"{model.max_model_len} (config.json max_position_embeddings): serving {model.max_model_len} tokens per "
            "sequence")
    log.warning("%s", said)
    cfg.engine.max_model_len = model.max_model_len
    return said


async def serve(cfg: ServerConfig, model_path: str, factory: Callable[[str], Engine] | None = None) -> None:
    """factory: engine id -> Engine (default: real vLLM engines per the config)."""
    lifeline.mark_front_end()        # engine processes started from here die with this process (SIGKILL too)
    model = ModelInfo.load(model_path, cfg.engine.max_model_len)
    fit_context(cfg, model)
    freed = sweep_stale_roots()
    if freed:
        log.info("removed %.1f MB of weight-push staging left by server processes that no longer run", freed / 1e6)
    if factory is None:
        from rollout_service.engine.vllm_engine import check_supported

        check_supported(cfg.engine, moe=model.moe is not None, head_size=model.head_size)   # ConfigError
    server = RolloutServer(cfg, model, factory or engine_factory(cfg, model_path))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    stopper = asyncio.create_task(server.wait_and_stop())
    try:
        await server.start()
    except BaseException:
        server.request_stop()
        await stopper
        raise
    forkserver.release_if_unused()     # started by `rollout-service serve` for engines that did not take it
    await stopper
