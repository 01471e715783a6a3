"""A partial sample being continued (Prompt.partial): the tokens generated before, joined to what the engine adds.

The engine sees only a longer prompt (the prompt plus the partial's tokens) and a smaller max_tokens; the pool puts
the two parts back together, so the client gets one sample, indexed from the partial's first token, whatever
engine (local or Ray) generated the rest.
"""
from __future__ import annotations

import msgspec

from rollout_service.engine.types import Routes, SeqResult, TokenDelta, joined_spans


class Partial(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Tokens already generated, with what the sample carries for them (checked by validation.check_generate)."""

    token_ids: list[int]
    logprobs: list[float]
    version_spans: list[tuple[int, int]]         # (policy_version, first_token), the first at 0
    top_token_ids: list[list[int]] = []          # [len][k] when the request asks for top_logprobs = k
    top_logprobs: list[list[float]] = []
    routed_experts: Routes | None = None         # its rows [0, prompt + len - 1), when the client kept them

    def __len__(self) -> int:
        return len(self.token_ids)

    def joined(self, r: SeqResult) -> SeqResult:
        """The whole sample: this partial followed by the engine's result r (r's indices start after it)."""
        spans = joined_spans(self.version_spans if len(self) else [], [(v, t + len(self)) for v, t in r.version_spans])
        routes = r.routed_experts        # rows are indexed in the whole sequence already (the engine's prompt
        if routes is not None and self.routed_experts is not None:   # is the prompt and this partial's tokens)
            routes = self.routed_experts.then(routes)
        return msgspec.structs.replace(
            r, routed_experts=routes, token_ids=self.token_ids + r.token_ids, logprobs=self.logprobs + r.logprobs,
            top_token_ids=self.top_token_ids + r.top_token_ids, top_logprobs=self.top_logprobs + r.top_logprobs,
            version_spans=spans, policy_version=spans[0][0] if spans else r.policy_version)

    def shifted(self, d: TokenDelta) -> TokenDelta:
        """An engine delta, indexed in the whole sample."""
        n = len(self)
        return msgspec.structs.replace(d, start=d.start + n, version_spans=[(v, t + n) for v, t in d.version_spans])
