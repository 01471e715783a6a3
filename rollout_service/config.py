"""Server configuration: one msgspec Struct, loaded from a TOML/JSON file and/or CLI flags.

Unknown fields in a config file are rejected with a message naming them.
"""
from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import msgspec

SPEC_METHODS = ("none", "draft_model", "eagle3", "ngram", "mtp")
K_CONTROLS = ("auto", "fixed")


class SpeculationConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Speculative decoding for every engine of the server."""

    method: str = "none"              # none | draft_model | eagle3 | ngram | mtp
    model: str = ""                   # drafter directory (draft_model, eagle3)
    num_speculative_tokens: int = 3   # k: tokens drafted per step
    # k by the engine's batch size (vLLM's dynamic speculative decoding): [first, last, k] ranges of running
    # sequences, the first starting at 1, each k <= num_speculative_tokens; k = 0 turns drafting off for that
    # range (where verifying costs more than it gains). [] drafts k at every batch size.
    k_by_batch_size: list[tuple[int, int, int]] = msgspec.field(default_factory=list)
    # How k is chosen each engine step when no k_by_batch_size is given: "auto" (speculation/k_controller.py:
    # from the step times and acceptance the engine measures, 0 where drafting does not pay) or "fixed" (always k).
    k_control: str = "auto"
    draft_sampling: str = "probabilistic"   # probabilistic | greedy drafting (draft_model, eagle3, mtp)
    prompt_lookup_min: int = 2        # ngram only
    prompt_lookup_max: int = 5        # ngram only
    draft_cost: float = -1.0          # one drafter step / one target step, as bench/speculation.py measures
                                      # it (-1: unknown; ngram counts as 0); drives the break-even warning


def k_mode(sp: SpeculationConfig) -> str:
    """How the engines pick k: "none" (no speculation), "schedule" (k_by_batch_size), "auto" or "fixed"."""
    if sp.method == "none":
        return "none"
    return "schedule" if sp.k_by_batch_size else sp.k_control


WEIGHT_RELOADS = ("shadow", "in_place")


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How each vLLM engine is built."""

    model: str = ""                   # local HF model directory; "" = the embedded default model
    dtype: str = "auto"               # "auto", "bfloat16", "float16" or "float32"
    max_model_len: int = 2048         # context length (prompt + generated tokens)
    max_num_seqs: int = 64            # sequences an engine batches at once
    kv_cache_gb: float = 2.0          # KV cache per engine on CPU (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1     # GPUs per engine (GPU nodes)
    # How commits load weights: "shadow" prepares them beside the served ones while generating and pauses
    # only to swap (needs memory for a second copy of the weights); "in_place" loads them while paused.
    weight_reload: str = "shadow"
    speculation: SpeculationConfig = msgspec.field(default_factory=SpeculationConfig)


class SecurityConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Authentication and TLS. Tokens are read from files (or ROLLOUT_AUTH_TOKEN / ROLLOUT_ADMIN_TOKEN), never
    from the command line, and never logged."""

    token_file: str = ""              # bearer token every RPC needs (HTTP too, except /healthz)
    admin_token_file: str = ""        # bearer token PushWeights / UpdateDraft / LoadWeights need
    tls_cert: str = ""                # PEM server certificate (chain); with tls_key: serve TLS on both ports
    tls_key: str = ""                 # PEM private key
    tls_client_ca: str = ""           # PEM CA: when set, clients must present a certificate it signed (mTLS)
    allow_insecure_remote: bool = False   # serve a non-loopback address without authentication
    # Directories LoadWeights may read below (symlinks followed); [] = the service's cache directory
    # ($ROLLOUT_SERVICE_HOME, else ~/.cache/rollout-service), where prepared models and drafters live.
    weights_roots: list[str] = msgspec.field(default_factory=list)


class RayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Engines as Ray actors (engine/ray_engine.py); empty address: engines in this process."""

    address: str = ""                 # "auto" (the local cluster), or "HOST:6379"
    cpus_per_engine: float = 1.0      # CPUs reserved in each engine's placement group
    gpus_per_engine: int = 0          # GPUs per engine (GPU nodes: = engine.tensor_parallel_size)


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole server."""

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    engines: int = 1
    max_queue: int = 1024             # sequences admitted (queued or running) before RESOURCE_EXHAUSTED
    max_prompts_per_request: int = 256
    max_samples_per_prompt: int = 64
    max_message_mb: int = 64          # gRPC max receive/send message size
    max_new_tokens: int = 0           # cap on sampling.max_tokens (0: up to the context length)
    max_streams_per_client: int = 64  # concurrent Generate streams per client (token, or peer address)
    idempotency_ttl_s: float = 600.0  # how long finished requests are kept for replay
    shutdown_grace_s: float = 5.0
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


class ConfigError(ValueError):
    """A config file or flag is invalid; the message names the field."""


def load_config(path: str | os.PathLike | None = None, **overrides) -> ServerConfig:
    """Read `path` (TOML or JSON; optional), then apply non-None overrides (dotted keys allowed)."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        try:
            raw = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config file {p} is not valid {p.suffix.lstrip('.') or 'json'}: {e}") from e
    for key, value in overrides.items():
        if value is None:
            continue
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        cfg = msgspec.convert(raw, ServerConfig)
    except msgspec.ValidationError as e:
        where = f"config file {path}" if path else "configuration"
        raise ConfigError(f"{where}: {e}") from e
    _check(cfg)
    return cfg


OPEN_BATCH = 1 << 20      # "and above" in a k_by_batch_size range (vLLM clamps ranges to max_num_seqs)


def parse_k_schedule(text: str) -> list[tuple[int, int, int]]:
    """`1-4:3,5-16:1,17-:0` (batch sizes first-last, an open last; then k) -> [(1, 4, 3), (5, 16, 1), (17, OPEN, 0)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)-(\d*):(\d+)", part)
        if not m:
            raise ConfigError(f"k_by_batch_size: {part!r} is not FIRST-LAST:K (for example 1-8:3 or 9-:0)")
        out.append((int(m[1]), int(m[2]) if m[2] else OPEN_BATCH, int(m[3])))
    return out


def _k_schedule_rules(schedule, k: int) -> list[tuple[bool, str]]:
    rules, after = [], 0
    for first, last, kk in schedule:
        where = f"engine.speculation.k_by_batch_size range [{first}, {last}, {kk}]"
        rules += [(1 <= first <= last, f"{where}: need 1 <= first <= last"),
                  (first > after, f"{where}: ranges must be sorted and must not overlap"),
                  (0 <= kk <= k, f"{where}: k must be in [0, num_speculative_tokens={k}]")]
        after = last
    if schedule:
        rules.append((schedule[0][0] == 1,
                      "engine.speculation.k_by_batch_size: the first range must start at batch size 1"))
    return rules


def _check(cfg: ServerConfig) -> None:
    rules = [
        (cfg.engines >= 1, "engines must be >= 1"),
        (cfg.max_queue >= 1, "max_queue must be >= 1"),
        (cfg.max_prompts_per_request >= 1, "max_prompts_per_request must be >= 1"),
        (cfg.max_samples_per_prompt >= 1, "max_samples_per_prompt must be >= 1"),
        (0 <= cfg.grpc_port < 65536 and 0 <= cfg.http_port < 65536, "ports must be in [0, 65535]"),
        (cfg.engine.max_model_len >= 16, "engine.max_model_len must be >= 16"),
        (cfg.engine.dtype in ("auto", "bfloat16", "float16", "float32"),
         "engine.dtype must be one of auto, bfloat16, float16, float32"),
        (cfg.engine.kv_cache_gb > 0, "engine.kv_cache_gb must be > 0"),
        (cfg.max_new_tokens >= 0, "max_new_tokens must be >= 0 (0: up to the context length)"),
        (cfg.max_streams_per_client >= 1, "max_streams_per_client must be >= 1"),
        (cfg.engine.tensor_parallel_size >= 1, "engine.tensor_parallel_size must be >= 1"),
        (cfg.engine.weight_reload in WEIGHT_RELOADS,
         f"engine.weight_reload must be one of {', '.join(WEIGHT_RELOADS)}"),
        (cfg.ray.cpus_per_engine > 0 and cfg.ray.gpus_per_engine >= 0,
         "ray.cpus_per_engine must be > 0 and ray.gpus_per_engine >= 0"),
    ]
    sec = cfg.security
    rules += [
        (bool(sec.tls_cert) == bool(sec.tls_key), "security: tls_cert and tls_key go together"),
        (not sec.tls_client_ca or sec.tls_cert, "security.tls_client_ca needs tls_cert and tls_key (TLS)"),
        (all(r and os.path.isabs(os.path.expanduser(r)) for r in sec.weights_roots),
         "security.weights_roots: every root must be an absolute directory path"),
    ]
    sp = cfg.engine.speculation
    rules += [
        (sp.method in SPEC_METHODS, f"engine.speculation.method must be one of {', '.join(SPEC_METHODS)}"),
        (1 <= sp.num_speculative_tokens <= 16, "engine.speculation.num_speculative_tokens must be in [1, 16]"),
        (sp.draft_sampling in ("probabilistic", "greedy"),
         "engine.speculation.draft_sampling must be probabilistic or greedy"),
        (1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max,
         "engine.speculation: need 1 <= prompt_lookup_min <= prompt_lookup_max"),
        (sp.method not in ("draft_model", "eagle3") or sp.model,
         f"engine.speculation.model: method {sp.method} needs a drafter directory"),
        (sp.k_control in K_CONTROLS, f"engine.speculation.k_control must be one of {', '.join(K_CONTROLS)}"),
        (not sp.k_by_batch_size or sp.method != "none",
         "engine.speculation.k_by_batch_size needs a speculation method"),
    ]
    rules += _k_schedule_rules(sp.k_by_batch_size, sp.num_speculative_tokens)
    for ok, msg in rules:
        if not ok:
            raise ConfigError(msg)
