"""Internal messages between the pool and its engines (msgspec Structs; unknown fields rejected)."""
from __future__ import annotations

import msgspec

# A LoRA adapter's directory as PEFT writes it and vLLM loads it (the pool and a Ray engine name its files)
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


class SeqRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One sequence to generate: a single sample of one prompt."""

    seq_id: str                      # unique within the server's lifetime (engine request id)
    prompt_token_ids: list[int]      # [prompt_len]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0: disabled
    max_tokens: int = 128
    stop: list[str] = []
    stop_token_ids: list[int] = []
    seed: int | None = None
    ignore_eos: bool = False
    # Decode text (the sample's text, stop strings, the log-prob tokens' strings). vLLM does it in the front
    # end's event loop, token by token: under load a batch of outputs held the loop 0.6 s. Off unless the
    # request has stop strings or asked for text.
    detokenize: bool = True
    top_logprobs: int = 0            # k most likely tokens per position, under the processed distribution
    stream: bool = False             # report new tokens per engine step (Engine.generate's on_delta)
    return_routed_experts: bool = False   # routing replay: the result carries Routes (an MoE policy)
    routes_from: int = 0             # the first row returned (rows before it: the continued partial's own)
    # a LoRA adapter policy (GenerateRequest.policy): vLLM's LoRARequest (name, id, PEFT directory) and the
    # adapter version the sample reports; lora_id 0: the base policy
    lora_name: str = ""
    lora_id: int = 0
    lora_path: str = ""
    adapter_version: int = 0
    # a chat prompt's tool_choice "required" or a named function: sampling constrained as vLLM's chat endpoint
    # constrains it (vLLM's StructuredOutputsParams fields as JSON text: a structural tag or a JSON schema); "": none
    structured_outputs: str = ""


class Routes(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Routed expert ids of consecutive rows of a sequence: row r belongs to the token at position r of prompt +
    generated tokens (the routes computed when it was a forward pass's input), rows [first_row, first_row + rows).
    version_spans: (policy_version, first row it routed), as indices of the whole sequence."""

    first_row: int
    rows: int
    layers: int
    top_k: int
    dtype: str                       # "uint8" | "uint16"
    data: bytes                      # [rows, layers, top_k], little-endian `dtype`, row-major
    version_spans: list[tuple[int, int]] = []

    @property
    def end(self) -> int:
        return self.first_row + self.rows

    def then(self, more: "Routes") -> "Routes":
        """These rows followed by `more` (which starts where these end)."""
        if more.first_row != self.end:
            raise ValueError(f"routes starting at row {more.first_row} follow rows ending at {self.end}")
        return msgspec.structs.replace(self, rows=self.rows + more.rows, data=self.data + more.data,
                                       version_spans=joined_spans(self.version_spans, more.version_spans))

    def since(self, row: int) -> "Routes":
        """The rows from index `row` (>= first_row) on."""
        off = max(row - self.first_row, 0)
        width = self.layers * self.top_k * (1 if self.dtype == "uint8" else 2)
        spans = [(v, max(t, row)) for i, (v, t) in enumerate(self.version_spans)
                 if i + 1 == len(self.version_spans) or self.version_spans[i + 1][1] > row]
        return msgspec.structs.replace(self, first_row=self.first_row + off, rows=self.rows - off,
                                       data=self.data[off * width:], version_spans=spans)


def route_spans(token_spans: list[tuple[int, int]], prompt_len: int, first_row: int) -> list[tuple[int, int]]:
    """The policy versions that routed rows [first_row, ...) of a sequence whose engine prompt has `prompt_len`
    tokens, from the versions that generated its tokens: row r was an input of the step that produced token
    r - prompt_len + 1 (the prompt's rows: of the step that produced token 0)."""
    out = []
    for v, t in token_spans:
        row = max(prompt_len + t - 1 if t else 0, first_row)
        if out and out[-1][1] == row:
            out[-1] = (v, row)
        elif not out or out[-1][0] != v:
            out.append((v, row))
    return out


class SeqResult(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A finished sequence."""

    token_ids: list[int]             # [gen_len]
    logprobs: list[float]            # [gen_len], processed distribution (after temperature/top-k/top-p)
    finish_reason: str               # "stop" | "length" | "abort"
    stop_string: str = ""
    text: str = ""
    policy_version: int = 0
    version_spans: list[tuple[int, int]] = []   # (policy_version, first_token)
    draft_version: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    spec_steps: int = 0              # verify steps that carried drafts
    accepted_per_pos: list[int] = []  # [k] steps whose i-th draft was accepted
    top_token_ids: list[list[int]] = []     # [gen_len][top_logprobs], most likely first
    top_logprobs: list[list[float]] = []    # [gen_len][top_logprobs], processed distribution
    num_cached_tokens: int = 0       # prompt tokens found in the engine's prefix cache (not prefilled again)
    routed_experts: Routes | None = None    # with SeqRequest.return_routed_experts


class TokenDelta(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Tokens an unfinished sequence produced since its previous delta (one engine step, or several merged)."""

    start: int                       # index of token_ids[0] in the whole sequence
    token_ids: list[int]             # [new]
    logprobs: list[float]            # [new]
    version_spans: list[tuple[int, int]]    # (policy_version, first_token as an index in the whole sequence)
    top_token_ids: list[list[int]] = []     # [new][top_logprobs]
    top_logprobs: list[list[float]] = []
    routed_experts: Routes | None = None    # rows computed since the previous delta (may be none)


def joined_spans(first: list[tuple[int, int]], then: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Version spans (policy_version, first_token) of a sequence followed by those of its continuation, indexed in
    the whole sequence: a continuation's span of the version already running adds nothing."""
    out = list(first)
    for v, t in then:
        if not out or out[-1][0] != v:
            out.append((v, t))
    return out
