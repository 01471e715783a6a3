from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class InFlightMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IN_FLIGHT_UNSPECIFIED: _ClassVar[InFlightMode]
    IN_FLIGHT_ABORT: _ClassVar[InFlightMode]
    IN_FLIGHT_WAIT: _ClassVar[InFlightMode]
    IN_FLIGHT_KEEP: _ClassVar[InFlightMode]

class WeightTarget(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TARGET_UNSPECIFIED: _ClassVar[WeightTarget]
    TARGET_POLICY: _ClassVar[WeightTarget]
    TARGET_DRAFTER: _ClassVar[WeightTarget]
    TARGET_ADAPTER: _ClassVar[WeightTarget]

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_STARTING: _ClassVar[EngineState]
    ENGINE_STATE_READY: _ClassVar[EngineState]
    ENGINE_STATE_PAUSED: _ClassVar[EngineState]
    ENGINE_STATE_UNHEALTHY: _ClassVar[EngineState]
    ENGINE_STATE_STOPPED: _ClassVar[EngineState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
IN_FLIGHT_UNSPECIFIED: InFlightMode
IN_FLIGHT_ABORT: InFlightMode
IN_FLIGHT_WAIT: InFlightMode
IN_FLIGHT_KEEP: InFlightMode
TARGET_UNSPECIFIED: WeightTarget
TARGET_POLICY: WeightTarget
TARGET_DRAFTER: WeightTarget
TARGET_ADAPTER: WeightTarget
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_STARTING: EngineState
ENGINE_STATE_READY: EngineState
ENGINE_STATE_PAUSED: EngineState
ENGINE_STATE_UNHEALTHY: EngineState
ENGINE_STATE_STOPPED: EngineState

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "tools", "tool_choice", "chat_template_kwargs", "continue_final_message", "no_generation_prompt", "prefix_token_ids", "num_prefix_messages", "exclude_reasoning")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NO_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_REASONING_FIELD_NUMBER: _ClassVar[int]
    messages: str
    tools: str
    tool_choice: str
    chat_template_kwargs: str
    continue_final_message: bool
    no_generation_prompt: bool
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prefix_messages: int
    exclude_reasoning: bool
    def __init__(self, messages: _Optional[str] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., chat_template_kwargs: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., no_generation_prompt: _Optional[bool] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ..., num_prefix_messages: _Optional[int] = ..., exclude_reasoning: _Optional[bool] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class AssistantMessage(_message.Message):
    __slots__ = ("content", "reasoning", "tool_calls")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    content: str
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, content: _Optional[str] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class RenderRequest(_message.Message):
    __slots__ = ("chat", "return_text")
    CHAT_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    chat: ChatPrompt
    return_text: bool
    def __init__(self, chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., return_text: _Optional[bool] = ...) -> None: ...

class RenderResult(_message.Message):
    __slots__ = ("token_ids", "num_prefix_tokens", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prefix_tokens: int
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_prefix_tokens: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class ParseRequest(_message.Message):
    __slots__ = ("token_ids", "chat", "prompt_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat: ChatPrompt
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids", "text", "apply_chat_template", "partial", "chat")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    apply_chat_template: bool
    partial: PartialSample
    chat: ChatPrompt
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., partial: _Optional[_Union[PartialSample, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ...) -> None: ...

class PartialSample(_message.Message):
    __slots__ = ("token_ids", "logprobs", "version_spans", "top_token_ids", "top_logprobs", "routed_experts", "policy")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    routed_experts: RoutedExperts
    policy: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., policy: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "ignore_eos", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "n", "sampling", "min_policy_version", "return_text", "top_logprobs", "stream_tokens", "return_partial", "session_id", "return_routed_experts", "policy", "policy_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STREAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    n: int
    sampling: SamplingParams
    min_policy_version: int
    return_text: bool
    top_logprobs: int
    stream_tokens: bool
    return_partial: bool
    session_id: str
    return_routed_experts: bool
    policy: str
    policy_version: int
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., min_policy_version: _Optional[int] = ..., return_text: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., stream_tokens: _Optional[bool] = ..., return_partial: _Optional[bool] = ..., session_id: _Optional[str] = ..., return_routed_experts: _Optional[bool] = ..., policy: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("ids", "shape", "dtype", "version_spans", "first_row")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    first_row: int
    def __init__(self, ids: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., first_row: _Optional[int] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("policy_version", "first_token")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    first_token: int
    def __init__(self, policy_version: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "stop_string", "policy_version", "version_spans", "draft_version", "num_drafted", "num_accepted", "text", "num_prompt_tokens", "prompt_token_ids", "top_token_ids", "top_logprobs", "delta", "delta_start", "num_cached_tokens", "routed_experts", "policy", "message")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_START_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    stop_string: str
    policy_version: int
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    draft_version: int
    num_drafted: int
    num_accepted: int
    text: str
    num_prompt_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    delta: bool
    delta_start: int
    num_cached_tokens: int
    routed_experts: RoutedExperts
    policy: str
    message: AssistantMessage
    def __init__(self, prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., policy_version: _Optional[int] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., draft_version: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., text: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., delta: _Optional[bool] = ..., delta_start: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., policy: _Optional[str] = ..., message: _Optional[_Union[AssistantMessage, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("version", "target", "total_bytes", "sha256", "in_flight", "partial", "adapter", "adapter_config", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    target: WeightTarget
    total_bytes: int
    sha256: str
    in_flight: InFlightMode
    partial: bool
    adapter: str
    adapter_config: str
    base_version: int
    def __init__(self, version: _Optional[int] = ..., target: _Optional[_Union[WeightTarget, str]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., in_flight: _Optional[_Union[InFlightMode, str]] = ..., partial: _Optional[bool] = ..., adapter: _Optional[str] = ..., adapter_config: _Optional[str] = ..., base_version: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data", "indices")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    indices: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., indices: _Optional[bytes] = ...) -> None: ...

class TensorBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class PushTrailer(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    trailer: PushTrailer
    batch: TensorBatch
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[PushTrailer, _Mapping]] = ..., batch: _Optional[_Union[TensorBatch, _Mapping]] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("version", "target", "path", "in_flight", "partial", "adapter", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    target: WeightTarget
    path: str
    in_flight: InFlightMode
    partial: bool
    adapter: str
    base_version: int
    def __init__(self, version: _Optional[int] = ..., target: _Optional[_Union[WeightTarget, str]] = ..., path: _Optional[str] = ..., in_flight: _Optional[_Union[InFlightMode, str]] = ..., partial: _Optional[bool] = ..., adapter: _Optional[str] = ..., base_version: _Optional[int] = ...) -> None: ...

class PushTimings(_message.Message):
    __slots__ = ("receive_s", "validate_s", "apply_s", "pause_s", "total_s", "prepare_s")
    RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_S_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PREPARE_S_FIELD_NUMBER: _ClassVar[int]
    receive_s: float
    validate_s: float
    apply_s: float
    pause_s: float
    total_s: float
    prepare_s: float
    def __init__(self, receive_s: _Optional[float] = ..., validate_s: _Optional[float] = ..., apply_s: _Optional[float] = ..., pause_s: _Optional[float] = ..., total_s: _Optional[float] = ..., prepare_s: _Optional[float] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("version", "target", "num_tensors", "num_bytes", "partial", "timings", "base_version", "fingerprint")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    version: int
    target: WeightTarget
    num_tensors: int
    num_bytes: int
    partial: bool
    timings: PushTimings
    base_version: int
    fingerprint: str
    def __init__(self, version: _Optional[int] = ..., target: _Optional[_Union[WeightTarget, str]] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., partial: _Optional[bool] = ..., timings: _Optional[_Union[PushTimings, _Mapping]] = ..., base_version: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: int
    def __init__(self, engines: _Optional[int] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("id", "state", "location", "running_sequences", "policy_version", "draft_version", "samples_finished", "restarts", "sessions")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: EngineState
    location: str
    running_sequences: int
    policy_version: int
    draft_version: int
    samples_finished: int
    restarts: int
    sessions: int
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[EngineState, str]] = ..., location: _Optional[str] = ..., running_sequences: _Optional[int] = ..., policy_version: _Optional[int] = ..., draft_version: _Optional[int] = ..., samples_finished: _Optional[int] = ..., restarts: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("policy_version", "draft_version", "num_drafted", "num_accepted", "acceptance_rate", "mean_acceptance_length", "per_position_acceptance", "expected_speedup")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PER_POSITION_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    draft_version: int
    num_drafted: int
    num_accepted: int
    acceptance_rate: float
    mean_acceptance_length: float
    per_position_acceptance: _containers.RepeatedScalarFieldContainer[float]
    expected_speedup: float
    def __init__(self, policy_version: _Optional[int] = ..., draft_version: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., per_position_acceptance: _Optional[_Iterable[float]] = ..., expected_speedup: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("model", "policy_version", "draft_version", "speculation_method", "num_speculative_tokens", "engines", "queue_depth", "queue_capacity", "tokens_per_second", "samples_per_second", "speculation", "ready", "uptime_s", "samples_total", "tokens_total", "warnings", "vocab_size", "max_model_len", "k_control", "weight_transfer", "patches", "sessions", "durability", "moe", "quantization", "adapters", "adapter_limits", "tenants", "policy_fingerprint", "draft_fingerprint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    K_CONTROL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    MOE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LIMITS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    policy_version: int
    draft_version: int
    speculation_method: str
    num_speculative_tokens: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    queue_depth: int
    queue_capacity: int
    tokens_per_second: float
    samples_per_second: float
    speculation: _containers.RepeatedCompositeFieldContainer[SpeculationStats]
    ready: bool
    uptime_s: float
    samples_total: int
    tokens_total: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    vocab_size: int
    max_model_len: int
    k_control: KControl
    weight_transfer: WeightTransferGroup
    patches: _containers.RepeatedCompositeFieldContainer[PatchState]
    sessions: SessionStats
    durability: Durability
    moe: MoeInfo
    quantization: Quantization
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterStatus]
    adapter_limits: AdapterLimits
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStatus]
    policy_fingerprint: str
    draft_fingerprint: str
    def __init__(self, model: _Optional[str] = ..., policy_version: _Optional[int] = ..., draft_version: _Optional[int] = ..., speculation_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., speculation: _Optional[_Iterable[_Union[SpeculationStats, _Mapping]]] = ..., ready: _Optional[bool] = ..., uptime_s: _Optional[float] = ..., samples_total: _Optional[int] = ..., tokens_total: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., k_control: _Optional[_Union[KControl, _Mapping]] = ..., weight_transfer: _Optional[_Union[WeightTransferGroup, _Mapping]] = ..., patches: _Optional[_Iterable[_Union[PatchState, _Mapping]]] = ..., sessions: _Optional[_Union[SessionStats, _Mapping]] = ..., durability: _Optional[_Union[Durability, _Mapping]] = ..., moe: _Optional[_Union[MoeInfo, _Mapping]] = ..., quantization: _Optional[_Union[Quantization, _Mapping]] = ..., adapters: _Optional[_Iterable[_Union[AdapterStatus, _Mapping]]] = ..., adapter_limits: _Optional[_Union[AdapterLimits, _Mapping]] = ..., tenants: _Optional[_Iterable[_Union[TenantStatus, _Mapping]]] = ..., policy_fingerprint: _Optional[str] = ..., draft_fingerprint: _Optional[str] = ...) -> None: ...

class Durability(_message.Message):
    __slots__ = ("state_dir", "restored_policy_version", "restored_draft_version")
    STATE_DIR_FIELD_NUMBER: _ClassVar[int]
    RESTORED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    state_dir: str
    restored_policy_version: int
    restored_draft_version: int
    def __init__(self, state_dir: _Optional[str] = ..., restored_policy_version: _Optional[int] = ..., restored_draft_version: _Optional[int] = ...) -> None: ...

class Quantization(_message.Message):
    __slots__ = ("method", "scheme", "weights", "activations", "dtype", "drafter_method", "batch_invariant")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_METHOD_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    method: str
    scheme: str
    weights: str
    activations: str
    dtype: str
    drafter_method: str
    batch_invariant: bool
    def __init__(self, method: _Optional[str] = ..., scheme: _Optional[str] = ..., weights: _Optional[str] = ..., activations: _Optional[str] = ..., dtype: _Optional[str] = ..., drafter_method: _Optional[str] = ..., batch_invariant: _Optional[bool] = ...) -> None: ...

class MoeInfo(_message.Message):
    __slots__ = ("num_experts", "top_k", "num_layers", "capture")
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    num_experts: int
    top_k: int
    num_layers: int
    capture: str
    def __init__(self, num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., num_layers: _Optional[int] = ..., capture: _Optional[str] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("sessions", "hits", "moved_unavailable", "moved_overloaded", "started", "evicted")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MOVED_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MOVED_OVERLOADED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    hits: int
    moved_unavailable: int
    moved_overloaded: int
    started: int
    evicted: int
    def __init__(self, sessions: _Optional[int] = ..., hits: _Optional[int] = ..., moved_unavailable: _Optional[int] = ..., moved_overloaded: _Optional[int] = ..., started: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class KControl(_message.Message):
    __slots__ = ("mode", "steps_by_k", "acceptance", "draft_version", "choices", "drafter_off_steps")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_K_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_OFF_STEPS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    steps_by_k: _containers.RepeatedScalarFieldContainer[int]
    acceptance: _containers.RepeatedScalarFieldContainer[float]
    draft_version: int
    choices: _containers.RepeatedCompositeFieldContainer[KChoice]
    drafter_off_steps: int
    def __init__(self, mode: _Optional[str] = ..., steps_by_k: _Optional[_Iterable[int]] = ..., acceptance: _Optional[_Iterable[float]] = ..., draft_version: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[KChoice, _Mapping]]] = ..., drafter_off_steps: _Optional[int] = ...) -> None: ...

class KChoice(_message.Message):
    __slots__ = ("engine", "batch_sizes", "chosen_k", "step_ms", "expected_speedup", "realized_speedup", "drafter_off")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_K_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    REALIZED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_OFF_FIELD_NUMBER: _ClassVar[int]
    engine: str
    batch_sizes: str
    chosen_k: int
    step_ms: _containers.RepeatedScalarFieldContainer[float]
    expected_speedup: float
    realized_speedup: float
    drafter_off: bool
    def __init__(self, engine: _Optional[str] = ..., batch_sizes: _Optional[str] = ..., chosen_k: _Optional[int] = ..., step_ms: _Optional[_Iterable[float]] = ..., expected_speedup: _Optional[float] = ..., realized_speedup: _Optional[float] = ..., drafter_off: _Optional[bool] = ...) -> None: ...

class WeightTransferInit(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "trainer_ranks", "timeout_s")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    backend: str
    master_address: str
    master_port: int
    trainer_ranks: int
    timeout_s: float
    def __init__(self, backend: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., trainer_ranks: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class EngineRanks(_message.Message):
    __slots__ = ("engine", "rank_offset", "ranks")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    rank_offset: int
    ranks: int
    def __init__(self, engine: _Optional[str] = ..., rank_offset: _Optional[int] = ..., ranks: _Optional[int] = ...) -> None: ...

class WeightTransferGroup(_message.Message):
    __slots__ = ("backend", "world_size", "trainer_ranks", "engines", "joined", "buffer_bytes", "group_id", "timeout_s")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANKS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    backend: str
    world_size: int
    trainer_ranks: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineRanks]
    joined: bool
    buffer_bytes: int
    group_id: str
    timeout_s: float
    def __init__(self, backend: _Optional[str] = ..., world_size: _Optional[int] = ..., trainer_ranks: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineRanks, _Mapping]]] = ..., joined: _Optional[bool] = ..., buffer_bytes: _Optional[int] = ..., group_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "src_rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    src_rank: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., src_rank: _Optional[int] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("version", "target", "in_flight", "partial", "tensors", "group_id", "adapter", "adapter_config")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    version: int
    target: WeightTarget
    in_flight: InFlightMode
    partial: bool
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    group_id: str
    adapter: str
    adapter_config: str
    def __init__(self, version: _Optional[int] = ..., target: _Optional[_Union[WeightTarget, str]] = ..., in_flight: _Optional[_Union[InFlightMode, str]] = ..., partial: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., group_id: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_config: _Optional[str] = ...) -> None: ...

class TransferReady(_message.Message):
    __slots__ = ("total_bytes",)
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ...) -> None: ...

class TransferProgress(_message.Message):
    __slots__ = ("ready", "result")
    READY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ready: TransferReady
    result: PushResult
    def __init__(self, ready: _Optional[_Union[TransferReady, _Mapping]] = ..., result: _Optional[_Union[PushResult, _Mapping]] = ...) -> None: ...

class CloseWeightTransferRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PatchState(_message.Message):
    __slots__ = ("name", "state", "reason", "serves", "without")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SERVES_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    reason: str
    serves: str
    without: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., serves: _Optional[str] = ..., without: _Optional[str] = ...) -> None: ...

class AdapterStatus(_message.Message):
    __slots__ = ("name", "version", "loaded_versions", "rank", "num_bytes", "target_modules", "running_sequences", "samples_total", "tokens_total", "num_drafted", "num_accepted", "tenant")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    num_bytes: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    running_sequences: int
    samples_total: int
    tokens_total: int
    num_drafted: int
    num_accepted: int
    tenant: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., loaded_versions: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ..., num_bytes: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., running_sequences: _Optional[int] = ..., samples_total: _Optional[int] = ..., tokens_total: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class AdapterLimits(_message.Message):
    __slots__ = ("max_adapters", "max_rank", "max_bytes", "versions_kept", "max_loras_per_batch")
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_KEPT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    max_adapters: int
    max_rank: int
    max_bytes: int
    versions_kept: int
    max_loras_per_batch: int
    def __init__(self, max_adapters: _Optional[int] = ..., max_rank: _Optional[int] = ..., max_bytes: _Optional[int] = ..., versions_kept: _Optional[int] = ..., max_loras_per_batch: _Optional[int] = ...) -> None: ...

class TenantStatus(_message.Message):
    __slots__ = ("name", "policies", "admitted_sequences", "max_sequences", "waiting_sequences", "samples_total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    policies: _containers.RepeatedScalarFieldContainer[str]
    admitted_sequences: int
    max_sequences: int
    waiting_sequences: int
    samples_total: int
    def __init__(self, name: _Optional[str] = ..., policies: _Optional[_Iterable[str]] = ..., admitted_sequences: _Optional[int] = ..., max_sequences: _Optional[int] = ..., waiting_sequences: _Optional[int] = ..., samples_total: _Optional[int] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...
