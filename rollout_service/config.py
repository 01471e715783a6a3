"""Server configuration: one schema, msgspec Structs whose fields say their type, limits, flag and meaning.

Loaded from a TOML/JSON file and/or `serve` flags; unknown fields are rejected with a message naming them.
The flags (cli.py), the single-field checks (msgspec, from each field's limits) and the table in
docs/configuration.md (`python -m rollout_service.config` prints it) derive from the Structs; rules that
relate several fields are in _check.
"""
from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal, get_args, get_origin

import msgspec

from rollout_service.hosts import allowed_entry_problem
from rollout_service.wire import DTYPES as TENSOR_DTYPES

SPEC_METHODS = ("none", "draft_model", "eagle3", "ngram", "suffix", "mtp")
MODEL_FREE_METHODS = ("ngram", "suffix")    # draft from the tokens seen so far: no drafter model, no draft cost
K_CONTROLS = ("auto", "fixed")
WEIGHT_RELOADS = ("shadow", "in_place")
QUANTIZATIONS = ("none", "int8", "fp8", "mxfp8")      # served precisions (engine/quantize.py)
WEIGHT_TRANSFERS = ("auto", "gloo", "nccl", "ipc", "sparse_nccl", "nccl_m2n", "none")
DTYPES = ("auto", *TENSOR_DTYPES)                # what the engine computes in; pushes may use it too
OPEN_BATCH = 1 << 20      # "and above" in a k_by_batch_size range (vLLM clamps ranges to max_num_seqs)


def option(typ, doc: str, flag: str | None = None, *, shown: str | None = None, metavar: str | None = None,
           **limits):
    """A config field's type with everything said about it once: `doc` (the flag's help and the documentation
    table's meaning), its `serve` flag, how the docs show its default (`shown`), and msgspec constraints
    (ge, gt, le): the flags, the validation and the table in docs/configuration.md all derive from it."""
    extra = {k: v for k, v in (("flag", flag), ("shown", shown), ("metavar", metavar)) if v is not None}
    if get_origin(typ) is Literal:
        extra["choices"] = get_args(typ)            # in the order written (msgspec's inspection sorts them)
    return Annotated[typ, msgspec.Meta(description=doc, extra=extra, **limits)]


class SpeculationConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Speculative decoding for every engine of the server."""

    method: option(Literal[SPEC_METHODS], "speculative decoding method", "--speculation") = "none"
    model: option(str, "drafter directory (draft_model: a small model with the policy's tokenizer; eagle3: an "
                       "EAGLE-3 head in vLLM's format, e.g. ~/.cache/rollout-service/drafters/"
                       "SmolLM2-135M-Instruct-eagle3 from `prepare-drafter --kind eagle3`)", "--draft-model") = ""
    num_speculative_tokens: option(
        int, "k, tokens drafted per step (with k_control = auto: the most the controller drafts)",
        "--num-speculative-tokens", ge=1, le=16) = 3
    k_control: option(
        Literal[K_CONTROLS],
        "without k_by_batch_size: `auto` chooses k = 0..num_speculative_tokens for every engine step from what the "
        "engine measures (step time by batch size and k, the drafter's acceptance per draft position; k = 0 where "
        "drafting does not pay; re-measured after every UpdateDraft; speculation/k_controller.py); `fixed` drafts "
        "k every step", "--k-control") = "auto"
    k_by_batch_size: option(
        list[tuple[int, int, int]],
        "k chosen per engine step by how many sequences the step runs (vLLM's dynamic speculative decoding): "
        "[[first, last, k], ...] ranges from batch size 1 up, each k <= num_speculative_tokens; k = 0 stops "
        "drafting where verifying costs more than it gains (on CPU, large batches). Bad ranges are refused at "
        "start-up, naming the range", "--k-by-batch-size", shown="`[]` = k at every batch size",
        metavar="FIRST-LAST:K,...") = msgspec.field(default_factory=list)
    quantization: option(
        Literal[QUANTIZATIONS],
        "the drafter's served precision (draft_model only; as engine.quantization); the drafter stays unquantized "
        "unless set. `int8` runs on a real engine here (2026-11-27: an int8 drafter over an int8 target samples, "
        "and an UpdateDraft of float weights is quantized at commit)", "--draft-quantization") = "none"
    draft_sampling: option(
        Literal["probabilistic", "greedy"],
        "the drafter samples (probabilistic) or takes its argmax (greedy); both are lossless (draft_model, eagle3, "
        "mtp)", "--draft-sampling") = "probabilistic"
    prompt_lookup_min: option(int, "smallest n-gram matched (ngram)", ge=1) = 2
    prompt_lookup_max: option(int, "largest n-gram matched (ngram)", ge=1) = 5
    suffix_max_spec_factor: option(
        float, "suffix: draft at most this many tokens per token of the matched suffix (vLLM's "
               "suffix_decoding_max_spec_factor; the drafts stop at num_speculative_tokens)", ge=0) = 1.0
    suffix_min_token_prob: option(
        float, "suffix: draft a token only where the suffix tree's estimate of its probability is at least this "
               "(vLLM's suffix_decoding_min_token_prob)", ge=0, le=1) = 0.1
    draft_cost: option(
        float,
        "one drafter step / one target step, as bench/speculation.py prints it (cost c); with it, GetStatus reports "
        "each drafter version's expected speedup (mean acceptance length / (1 + c k)) and warns (status and log) "
        "when speculation is slowing generation; n-gram and suffix count as 0", "--draft-cost",
        shown="-1 = unknown") = -1.0


def k_mode(sp: SpeculationConfig) -> str:
    """How the engines pick k: "none" (no speculation), "schedule" (k_by_batch_size), "auto" or "fixed"."""
    if sp.method == "none":
        return "none"
    return "schedule" if sp.k_by_batch_size else sp.k_control


LORA_RANKS = (8, 16, 32, 64, 128, 256)      # vLLM's max_lora_rank choices this service offers


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """LoRA adapters served as policies (GenerateRequest.policy; pool/adapters.py)."""

    max_adapters: option(int, "LoRA adapters (names) served at once; 0: none (vLLM's LoRA layers off: no cost "
                              "to the base policy). A push of one more is RESOURCE_EXHAUSTED", "--max-adapters",
                         ge=0) = 0
    max_rank: option(int, "largest LoRA rank accepted (vLLM's max_lora_rank: every engine sizes its LoRA buffers by "
                          "it); one of " + ", ".join(map(str, LORA_RANKS)), "--max-lora-rank") = 16
    max_adapter_mb: option(float, "largest adapter accepted, in MiB of tensor data", "--max-adapter-mb",
                           gt=0) = 256.0
    versions_kept: option(int, "versions of each adapter kept loaded on every engine (the latest and the ones "
                               "before it): a request may name any of them; samples in flight on an older one "
                               "finish on it before it is unloaded", "--adapter-versions-kept", ge=1) = 2
    max_loras_per_batch: option(int, "distinct adapter versions one engine step batches together (vLLM's "
                                     "max_loras; requests of more wait for the next steps)",
                                "--max-loras-per-batch", shown="0 = max_adapters", ge=0) = 0

    def per_batch(self) -> int:
        return self.max_loras_per_batch or self.max_adapters


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How each vLLM engine is built."""

    model: option(str, "local Hugging Face model directory, or `moe` (SmolLM2 upcycled into a mixture of experts: "
                       "`prepare-model --moe`)", "--model", shown="embedded SmolLM2-135M-Instruct") = ""
    dtype: option(Literal[DTYPES], "`auto` = the model's dtype, except float32 on CPUs without native bf16 (bf16 is "
                                   "3x slower there)", "--dtype") = "auto"
    max_model_len: option(int, "context length per sequence (prompt + generated tokens)", "--max-model-len",
                          ge=16) = 2048
    max_num_seqs: option(int, "sequences an engine batches at once", "--max-num-seqs") = 64
    kv_cache_gb: option(float, "KV cache per engine in GiB on CPU, fractions included (vLLM's kv_cache_memory_bytes)",
                        "--kv-cache-gb", gt=0) = 2.0
    gpu_memory_utilization: option(float, "share of each GPU an engine takes (GPU nodes)") = 0.85
    enforce_eager: option(bool, "skip torch.compile (faster start)") = True
    seed: option(int, "vLLM's engine seed (a request's seed decides its samples)") = 0
    tensor_parallel_size: option(int, "GPUs each engine shards the model over (inside its actor on Ray)",
                                 "--tensor-parallel-size", ge=1) = 1
    weight_reload: option(
        Literal[WEIGHT_RELOADS],
        "how commits load weights: `shadow` prepares them beside the served ones while generating and pauses only "
        "to swap them in (needs memory for a second copy of the weights during a commit); `in_place` loads them "
        "while paused (no extra memory; the pause lasts the whole load: 0.2-0.4 s for the default model on 2 cores, "
        "against ~20 ms for shadow). On GPU nodes whose memory is mostly given to the KV cache, in_place avoids "
        "running out of device memory", "--weight-reload") = "shadow"
    weight_transfer: option(
        Literal[WEIGHT_TRANSFERS],
        "the backend of InitWeightTransfer / TransferWeights (weights over a collective group, vLLM's weight-transfer "
        "engines): `auto` = `gloo` on CPU (this project's backend, vLLM's stateless gloo group), `nccl` on GPUs; "
        "`ipc`, `sparse_nccl`, `nccl_m2n`: vLLM's own (GPU nodes); `none`: only PushWeights and LoadWeights",
        "--weight-transfer") = "auto"
    weight_transfer_timeout_s: option(
        float, "how long a weight-transfer rendezvous or push waits for every rank (a trainer rank that never joins or "
               "dies mid-push fails it then, nothing changed)", "--weight-transfer-timeout-s", gt=0) = 120.0
    weight_transfer_max_timeout_s: option(
        float, "the longest timeout_s an InitWeightTransfer may ask for (INVALID_ARGUMENT naming timeout_s above it)",
        "--weight-transfer-max-timeout-s", gt=0) = 600.0
    weight_transfer_max_ranks: option(
        int, "the most trainer ranks a weight-transfer group may have (InitWeightTransfer.trainer_ranks; "
             "INVALID_ARGUMENT above it)", "--weight-transfer-max-ranks", ge=1) = 1024
    routed_experts: option(
        Literal["auto", "off"],
        "routing replay: `auto` captures the experts every token is routed to when the policy is a mixture of experts "
        "(vLLM's capture; GenerateRequest.return_routed_experts returns them); `off` saves the capture (requests "
        "asking for routes then get FAILED_PRECONDITION)", "--routed-experts") = "auto"
    quantization: option(
        Literal[QUANTIZATIONS],
        "the served precision, applied at start-up and at every commit: trainers push float32 / bfloat16 / float16 "
        "weights by any path and each engine quantizes them while it prepares the new version (scales from the "
        "pushed weights; engine/quantize.py). `int8`: W8A8 (compressed-tensors: int8 weights, one scale per output "
        "channel; int8 activations, one scale per token; oneDNN on CPU); `fp8`, `mxfp8`: vLLM's online quantization, "
        "GPU nodes only (refused at start-up on CPU). Samples carry the served (quantized) policy's log-probs",
        "--quantization") = "none"
    batch_invariant: option(
        bool, "vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1): a seeded sample's tokens and log-probs do not "
              "depend on what else is batched with it. GPU nodes only (Triton); refused at start-up on CPU (there, "
              "measured: a prefix-cache hit changes nothing; in a batch of 32 the tokens stay the same and the "
              "log-probs move by up to 2e-6 nats: tests/integration/test_batch_invariance.py)",
        "--batch-invariant") = False
    speculation: SpeculationConfig = msgspec.field(default_factory=SpeculationConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One tenant: a token scoped to its own adapters, with an admission quota (security.tenants)."""

    name: str
    token_file: str = ""             # file holding its bearer token (or token_env)
    token_env: str = ""              # environment variable holding it
    policies: list[str] = []         # adapter names it may sample and push; a trailing '*' matches a prefix
    max_sequences: int = 0           # its sequences admitted at once (0: max_queue)


class SecurityConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Authentication and TLS. Tokens are read from files (or ROLLOUT_AUTH_TOKEN / ROLLOUT_ADMIN_TOKEN), never
    from the command line, and never logged."""

    token_file: option(str, "file with the client bearer token (or env ROLLOUT_AUTH_TOKEN)", "--token-file") = ""
    admin_token_file: option(str, "file with the admin bearer token the control plane needs (or env "
                                  "ROLLOUT_ADMIN_TOKEN)", "--admin-token-file") = ""
    tls_cert: option(str, "PEM server certificate (chain); with tls_key: TLS on both ports", "--tls-cert") = ""
    tls_key: option(str, "PEM private key of tls_cert", "--tls-key") = ""
    tls_client_ca: option(str, "PEM CA client certificates must chain to (mutual TLS)", "--tls-client-ca") = ""
    allow_insecure_remote: option(bool, "serve a non-loopback host without authentication (trusted networks only)",
                                  "--allow-insecure-remote") = False
    weights_roots: option(
        list[str], "directories LoadWeights may read below (absolute; symlinks are followed before the check; the "
                   "flag repeats)", "--weights-root", metavar="DIR",
        shown="`[]` = the cache directory (`$ROLLOUT_SERVICE_HOME`, else `~/.cache/rollout-service`)",
    ) = msgspec.field(default_factory=list)
    weight_transfer_hosts: option(
        list[str], "where a weight-transfer group's master_address may resolve to (the engines dial it): `caller` "
                   "(the calling trainer's own address), IP addresses, CIDR blocks (`10.0.0.0/8`) or host names; "
                   "anything else is PERMISSION_DENIED naming master_address (the flag repeats)",
        "--weight-transfer-host", metavar="HOST",
        shown="`[]` = `caller` (a loopback caller: any loopback address)",
    ) = msgspec.field(default_factory=list)
    tenants: option(
        list[TenantConfig], "tenants sharing the pool (config file only): each `{name, token_file or token_env, "
                            "policies, max_sequences}`; a tenant's token samples and pushes only the adapters its "
                            "`policies` name (a trailing `*` matches a prefix), never the base policy, with at most "
                            "`max_sequences` admitted at once; an engine's slots go to tenants in turn (the fair "
                            "scheduler, pool/fair.py)",
        shown="`[]` = none") = msgspec.field(default_factory=list)


class RayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Engines as Ray actors (engine/ray_engine.py); empty address: engines in this process."""

    address: option(str, "run the engines as Ray actors on this cluster: `auto` (the cluster this node belongs "
                         "to) or HOST:6379; empty: engines in this process", "--ray-address") = ""
    cpus_per_engine: option(float, "CPUs reserved in each engine's placement group", "--ray-cpus-per-engine",
                            gt=0) = 1.0
    gpus_per_engine: option(int, "GPUs in each engine's placement group; set it to the tensor parallel size on "
                                 "GPU nodes", "--ray-gpus-per-engine", ge=0) = 0


SESSION_KEY_FROM = ("x-session-id", "x-user-id", "x-smg-routing-key", "session_id", "routing_key")


class SessionConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Session routing: every request with the same session key (GenerateRequest.session_id, the dialects' headers
    and fields) goes to the engine that holds the conversation's earlier turns in its prefix cache
    (pool/sessions.py)."""

    max_sessions: option(int, "sessions remembered for routing; the least recently used is forgotten first "
                              "(0: no session routing, every request least-loaded)", "--max-sessions",
                         ge=0) = 100_000
    max_imbalance: option(int, "a session's request goes to its engine while that engine holds at most this many "
                               "sequences more than the least-loaded ready engine; beyond it, to the least-loaded "
                               "one, and the session moves there (SGLang's cache-aware router has the like: "
                               "balance_abs_threshold, 64 there; 32 here is half an engine's default batch, "
                               "max_num_seqs)",
                          "--session-max-imbalance", ge=0) = 32
    key_from: option(list[str], "where the HTTP dialects read a request's session key: each name, in order, as a "
                                "request header, then as a top-level string field of the JSON body; the first "
                                "present wins (vLLM's routers: X-Session-ID, X-User-ID or a configured header; "
                                "SGLang's: X-SMG-Routing-Key, routing_key; add `user` to key on OpenAI's user "
                                "field; the flag repeats and replaces the list)", "--session-key-from",
                     metavar="NAME", shown="`" + ", ".join(SESSION_KEY_FROM) + "`",
                     ) = msgspec.field(default_factory=lambda: list(SESSION_KEY_FROM))


class ChatConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Chat for agents (rollout_service/chat/): how tool calls and reasoning are read from samples, with vLLM's own
    parsers, as `vllm serve` configures them."""

    tool_call_parser: option(str, "vLLM's tool-call parser (`vllm serve --tool-call-parser`: hermes, pythonic, "
                                  "qwen3_xml, ...): tools in a chat request are rendered by the model's chat template "
                                  "and the calls read from samples by it. `auto` = `hermes` where the model's chat "
                                  "template is this service's (the embedded model, models it prepares), else none; "
                                  "`none`: tool_choice auto / required / named are refused (400 / INVALID_ARGUMENT "
                                  "naming tool_choice), as vLLM refuses them without the flag",
                             "--tool-call-parser") = "auto"
    enable_auto_tool_choice: option(bool, "vLLM's --enable-auto-tool-choice: tool_choice `auto` reads tool calls "
                                          "with the tool-call parser (off: `auto` is refused as vLLM refuses it)",
                                    "--enable-auto-tool-choice") = True
    reasoning_parser: option(str, "vLLM's reasoning parser (`vllm serve --reasoning-parser`: qwen3, deepseek_r1, "
                                  "...): a sample's reasoning is returned apart from its content "
                                  "(reasoning_content, Sample.message.reasoning). `none` (default): reasoning stays "
                                  "in the content; this service's template writes `<think>` blocks, which `qwen3` "
                                  "reads", "--reasoning-parser") = "none"


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole server."""

    host: option(str, "bind address of both ports (not loopback: needs authentication, see security)",
                 "--host") = "127.0.0.1"
    grpc_port: option(int, "gRPC port (0 picks a free one)", "--grpc-port", ge=0, le=65535) = 50051
    http_port: option(int, "HTTP port: /healthz, /readyz, /metrics, /v1/status", "--http-port",
                      ge=0, le=65535) = 8000
    engines: option(int, "vLLM engines in this process's pool", "--engines", ge=1) = 1
    max_queue: option(int, "sequences admitted at once (queued + running) before RESOURCE_EXHAUSTED",
                      "--max-queue", ge=1) = 1024
    max_prompts_per_request: option(int, "prompts per Generate", ge=1) = 256
    max_samples_per_prompt: option(int, "n per Generate", ge=1) = 64
    max_message_mb: option(int, "largest request message in MiB (RESOURCE_EXHAUSTED naming max_message_mb)",
                           "--max-message-mb") = 64
    max_new_tokens: option(int, "cap on sampling.max_tokens (INVALID_ARGUMENT naming max_new_tokens)",
                           "--max-new-tokens", shown="0 = context length", ge=0) = 0
    max_top_logprobs: option(int, "most top-k log-probs per token a request may ask for (GenerateRequest."
                                  "top_logprobs, the dialects' logprobs / top_logprobs / top_logprobs_num; "
                                  "INVALID_ARGUMENT naming the field above it)", "--max-top-logprobs",
                             ge=0) = 20
    return_tokens_as_token_ids: option(bool, "vLLM's --return-tokens-as-token-ids: the vLLM dialect's log-prob "
                                             "tokens read `token_id:N` unless a request sets "
                                             "return_tokens_as_token_ids (OpenPipe ART reads token ids so)",
                                       "--return-tokens-as-token-ids") = False
    max_streams_per_client: option(int, "concurrent Generate streams per client (per token, else per peer "
                                        "address; RESOURCE_EXHAUSTED naming it)", "--max-streams-per-client",
                                   ge=1) = 64
    idempotency_ttl_s: option(float, "how long finished requests stay replayable (seconds)") = 600.0
    shutdown_grace_s: option(float, "grace period on SIGTERM (seconds)") = 5.0
    state_dir: option(str, "directory (on a volume) where the committed policy and drafter versions and their "
                           "weight files, and the LoRA adapters' committed versions, survive a restart: a restarted "
                           "server serves them again before it says ready (pool/committed.py, pool/adapters.py). "
                           "Empty: a restarted server serves its model's version 0 and no adapter, and says so "
                           "(GetStatus.durability)", "--state-dir", shown="`\"\"` = none") = ""
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    sessions: SessionConfig = msgspec.field(default_factory=SessionConfig)
    chat: ChatConfig = msgspec.field(default_factory=ChatConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


class ConfigError(ValueError):
    """A config file or flag is invalid; the message names the field."""


class Field(msgspec.Struct, frozen=True):
    """One config field as the schema says it: path ("engine.speculation.method"), type and default, and what
    option() recorded (doc, flag, how the docs show the default, limits, choices)."""

    path: str
    type: object
    default: object
    doc: str
    flag: str | None
    shown: str | None
    metavar: str | None
    limits: dict
    choices: tuple | None


def fields(struct: type = None, prefix: str = "") -> Iterator[Field]:
    """Every leaf field of ServerConfig (or `struct`), depth first in declaration order."""
    for f in msgspec.inspect.type_info(struct or ServerConfig).fields:
        path = prefix + f.name
        if isinstance(f.type, msgspec.inspect.StructType):
            yield from fields(f.type.cls, path + ".")
            continue
        meta = f.type if isinstance(f.type, msgspec.inspect.Metadata) else None
        inner = meta.type if meta else f.type
        extra = (meta.extra or {}) if meta else {}
        limits = {k: getattr(inner, k) for k in ("ge", "gt", "le", "lt") if getattr(inner, k, None) is not None}
        choices = extra.get("choices")
        default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
        yield Field(path, inner, default, (meta.extra_json_schema or {}).get("description", "") if meta else "",
                    extra.get("flag"), extra.get("shown"), extra.get("metavar"), limits, choices)


def field(path: str) -> Field:
    return next(f for f in fields() if f.path == path)


def _limits_text(f: Field) -> str:
    lo = f"[{f.limits['ge']}" if "ge" in f.limits else f"({f.limits['gt']}" if "gt" in f.limits else None
    hi = f"{f.limits['le']}]" if "le" in f.limits else f"{f.limits['lt']})" if "lt" in f.limits else None
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]


def _field_error(e: msgspec.ValidationError) -> str | None:
    """A field's own limits or choices, broken: the message the schema gives ("engines must be >= 1")."""
    m = re.search(r" - at `\$\.([\w.]+)`$", str(e))
    if not m:
        return None
    f = next((f for f in fields() if f.path == m[1]), None)
    if f is None:
        return None
    if f.choices and str(e).startswith("Invalid enum value"):
        return f"{f.path} must be one of {', '.join(f.choices)}"
    if f.limits and re.match(r"Expected `\w+` [<>]", str(e)):
        return f"{f.path} must be {_limits_text(f)}"
    return None


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
        raise ConfigError(_field_error(e) or f"{where}: {e}") from e
    _check(cfg)
    return cfg


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
    """The rules that relate several fields (each field's own limits and choices are in its type)."""
    sec, sp = cfg.security, cfg.engine.speculation
    rules = [
        (bool(sec.tls_cert) == bool(sec.tls_key), "security: tls_cert and tls_key go together"),
        (not sec.tls_client_ca or sec.tls_cert, "security.tls_client_ca needs tls_cert and tls_key (TLS)"),
        (all(r and os.path.isabs(os.path.expanduser(r)) for r in sec.weights_roots),
         "security.weights_roots: every root must be an absolute directory path"),
        (cfg.engine.weight_transfer_timeout_s <= cfg.engine.weight_transfer_max_timeout_s,
         "engine.weight_transfer_timeout_s must be <= engine.weight_transfer_max_timeout_s"),
        *((allowed_entry_problem(h) is None, f"security.weight_transfer_hosts: {allowed_entry_problem(h)}")
          for h in sec.weight_transfer_hosts),
        (sp.prompt_lookup_min <= sp.prompt_lookup_max,
         "engine.speculation: need 1 <= prompt_lookup_min <= prompt_lookup_max"),
        (sp.method not in ("draft_model", "eagle3") or sp.model,
         f"engine.speculation.model: method {sp.method} needs a drafter directory"),
        (not sp.k_by_batch_size or sp.method != "none",
         "engine.speculation.k_by_batch_size needs a speculation method"),
        (sp.quantization == "none" or sp.method == "draft_model",
         f"engine.speculation.quantization (--draft-quantization) {sp.quantization}: only a draft_model drafter is "
         f"quantized (method is {sp.method})"),
    ]
    lora = cfg.engine.lora
    rules.append((lora.max_rank in LORA_RANKS,
                  f"engine.lora.max_rank must be one of {', '.join(map(str, LORA_RANKS))}"))
    names = [t.name for t in sec.tenants]
    rules += [(len(set(names)) == len(names), "security.tenants: tenant names must be unique"),
              *((bool(t.name) and bool(t.token_file) != bool(t.token_env),
                 f"security.tenants[{i}]: needs a name and exactly one of token_file or token_env")
                for i, t in enumerate(sec.tenants)),
              *((t.max_sequences >= 0, f"security.tenants[{i}].max_sequences must be >= 0")
                for i, t in enumerate(sec.tenants)),
              (not sec.tenants or (sec.token_file or os.environ.get("ROLLOUT_ADMIN_TOKEN") or sec.admin_token_file),
               "security.tenants need the admin and client tokens too (security.token_file, admin_token_file)")]
    rules += _k_schedule_rules(sp.k_by_batch_size, sp.num_speculative_tokens)
    for ok, msg in rules:
        if not ok:
            raise ConfigError(msg)


def _shown_default(f: Field) -> str:
    if f.shown is not None:
        return f.shown
    if f.default == "" or f.default == []:
        return ""
    if isinstance(f.default, bool):
        return str(f.default).lower()
    if isinstance(f.default, str):
        return f"`{f.default}`"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def config_table() -> str:
    """The documentation table of every field (docs/configuration.md holds it; tests check it is current)."""
    rows = ["| field (flag) | default | meaning |", "| --- | --- | --- |"]
    for f in fields():
        flag = f" (`{f.flag}{' ' + f.metavar if f.metavar else ''}`)" if f.flag else ""
        meaning = f.doc
        if f.choices:
            meaning += "; one of " + ", ".join(f"`{c}`" for c in f.choices)
        if f.limits:
            meaning += f" ({_limits_text(f)})"
        rows.append(f"| `{f.path}`{flag} | {_shown_default(f)} | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(config_table(), end="")
