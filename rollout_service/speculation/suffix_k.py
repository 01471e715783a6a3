"""Suffix decoding with k chosen per step (the k controller or a k_by_batch_size schedule).

vLLM 0.32's SuffixDecodingProposer (Arctic Inference's suffix trees: it drafts from the tokens this request's
prompt and earlier responses, its own and other requests', continued with) asserts that every step drafts the
configured `num_speculative_tokens`, so dynamic speculative decoding, which tells the proposer how many tokens a
step drafts, stops the engine. Wrapped here: a step's k caps the draft (Arctic's `max_spec_tokens`), and at k = 0
the proposer still records the step's sampled tokens in its trees (they are what it drafts from later) but does not
search them: Arctic's `speculate` only reads the trees, and with a cap of 0 it still matches the context at every
length up to its depth, in both trees, per sequence, to return no token (issue 57: nothing a plain step does).
Sampling is untouched; the losslessness check covers suffix decoding with k changing per step through vLLM's
dynamic path, 3, 0 and 2 by batch size, the path the controller takes too (tests/integration/test_speculation.py).
"""
from __future__ import annotations

from types import SimpleNamespace


def _no_draft(*args, **kwargs) -> SimpleNamespace:
    """What SuffixDecodingCache.speculate returns with a cap of 0 (a draft without tokens), without the search."""
    return SimpleNamespace(token_ids=[])


def install() -> bool:
    """Patch SuffixDecodingProposer.propose once per process; False where vLLM has no suffix proposer."""
    try:
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    except ImportError:
        return False
    original = SuffixDecodingProposer.propose
    if getattr(original, "_rollout_any_k", False):
        return True

    def propose(self, num_speculative_tokens, *args, **kwargs):
        configured = self.num_speculative_tokens
        self.num_speculative_tokens = num_speculative_tokens       # read by the assert and as the draft's cap
        cache = self.suffix_cache
        if num_speculative_tokens == 0:
            cache.speculate = _no_draft                              # this call only: the instance's, not the class's
        try:
            return original(self, num_speculative_tokens, *args, **kwargs)
        finally:
            self.num_speculative_tokens = configured
            cache.__dict__.pop("speculate", None)

    propose._rollout_any_k = True
    SuffixDecodingProposer.propose = propose
    return True
