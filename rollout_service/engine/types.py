"""Internal messages between the pool and its engines (msgspec Structs; unknown fields rejected)."""
from __future__ import annotations

import msgspec


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


class TokenDelta(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Tokens an unfinished sequence produced since its previous delta (one engine step, or several merged)."""

    start: int                       # index of token_ids[0] in the whole sequence
    token_ids: list[int]             # [new]
    logprobs: list[float]            # [new]
    version_spans: list[tuple[int, int]]    # (policy_version, first_token as an index in the whole sequence)
    top_token_ids: list[list[int]] = []     # [new][top_logprobs]
    top_logprobs: list[list[float]] = []


def joined_spans(first: list[tuple[int, int]], then: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Version spans (policy_version, first_token) of a sequence followed by those of its continuation, indexed in
    the whole sequence: a continuation's span of the version already running adds nothing."""
    out = list(first)
    for v, t in then:
        if not out or out[-1][0] != v:
            out.append((v, t))
    return out
