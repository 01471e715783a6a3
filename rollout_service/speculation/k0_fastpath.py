"""k = 0 as cheap as a plain engine: a step in which no sequence carries a draft takes vLLM's plain sampling path.

vLLM 0.32's GPUModelRunner (the CPU model runner is a subclass) decides per engine, not per step, whether a step
is speculative: `_prepare_inputs` takes `use_spec_decode = self.speculative_config is not None`, so once a
drafter is configured every step builds speculative metadata and samples through the rejection sampler, even
when the k controller (speculation/k_controller.py) or a k_by_batch_size range scheduled no draft at all. On
these CPUs that zero-draft verification cost a 135M model's engine 20-45% of its throughput against a plain
engine (bench/k_zero.py). This patch makes the decision per step: when the scheduler output carries no draft
token for any sequence, `_prepare_inputs` runs as for an engine without speculation (logits of each sequence's
last token, no spec metadata), and vLLM's own code handles a step without spec metadata downstream (the plain
sampler; the drafter's first pass over the step's tokens, which keeps its KV cache in sync, takes its "no
verified drafts" inputs). The rest of the step (attention metadata, the drafter) is untouched.

And the n-gram proposer is not run for a step that drafts nothing (k = 0): vLLM 0.32 still searches every
sequence's history for a match (numba, in threads that compete with the model's on these cores) and then drafts
zero tokens from it. It keeps no state, so skipping it changes nothing else.

And the EAGLE-3 head's forward pass is not run for a step that drafts nothing: vLLM 0.32 still runs it (to write the
head's KV cache for the step's positions, in case drafting resumes) and then returns no draft. That pass, its
attention metadata and its inputs cost an EAGLE-3 engine about 13-15% of a plain engine's throughput at 32
sequences with k = 0 at every step (bench/k_zero.py, 2026-11-25). Skipping it leaves the head's KV cache unwritten
for those positions; when the controller drafts again (a batch's tail) the head attends to stale entries there.
Its input at each position is the target's own hidden states of that position, so it still drafts, with
whatever acceptance that leaves, which the controller measures and acts on (bench/k_zero.py --auto prints it).
A draft model keeps its pass: it has no other context than its own KV cache. Set ROLLOUT_K0_KEEP_DRAFTER_KV=1
to run the head's pass as vLLM does.

And the draft model's pass is skipped too where the k controller switched the drafter off (its step carries
`rollout_drafter_off`, speculation/k_scheduler.py): there drafting loses, so the pass that keeps the draft model's
KV cache in step (13-14% of a plain step at k = 0, below) buys nothing; when the controller re-tries drafting there,
the drafts are made from a KV cache with gaps, and their acceptance is what it measures.

Sampling is unchanged in distribution (a zero-draft rejection step emits exactly the target's sample for each
sequence), and the losslessness check covers it: tests/integration/test_speculation.py runs it with the k
controller switching between 0 and 3. Set ROLLOUT_DISABLE_K0_FASTPATH=1 to measure without it.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
KEEP_KV_ENV = "ROLLOUT_K0_KEEP_DRAFTER_KV"


def _no_drafts(scheduler_output) -> bool:
    return not any(scheduler_output.scheduled_spec_decode_tokens.values())


def install() -> bool:
    """Patch GPUModelRunner._prepare_inputs once per process (the V1 runner's; the patch registry,
    engine/patches.py, reports it skipped where vLLM uses its V2 runner)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_inputs
    if getattr(original, "_rollout_k0_fastpath", False):
        return True

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        spec = self.speculative_config
        if spec is None or not _no_drafts(scheduler_output):
            return original(self, scheduler_output, *args, **kwargs)
        self.speculative_config = None           # read only by the branch that builds the spec metadata
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec

    _prepare_inputs._rollout_k0_fastpath = True
    GPUModelRunner._prepare_inputs = _prepare_inputs
    _skip_idle_ngram()
    if os.environ.get(KEEP_KV_ENV) != "1":
        _skip_idle_eagle()
        _skip_off_draft_model()
    log.info("installed the k = 0 fast path: steps without drafts sample like a plain engine")
    return True


def _skip_at_k0(proposer_cls, no_drafts, when=lambda proposer: True) -> None:
    """Wrap proposer_cls.propose: for a step that drafts nothing (and `when(proposer)`), answer
    no_drafts(self, *args, **kwargs) (what propose would return with k = 0) without running the proposer."""
    original = proposer_cls.propose

    def propose(self, num_speculative_tokens, *args, **kwargs):
        if num_speculative_tokens == 0 and when(self):
            return no_drafts(self, *args, **kwargs)
        return original(self, num_speculative_tokens, *args, **kwargs)

    proposer_cls.propose = propose


def _skip_idle_ngram() -> None:
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    _skip_at_k0(NgramProposer, lambda self, sampled_token_ids, *args, **kwargs: [[] for _ in sampled_token_ids])


def _no_model_drafts(self, *args, **kwargs):
    """What SpecDecodeBaseProposer.propose returns at k = 0, without the drafter's pass."""
    import torch

    self.num_speculative_tokens = 0
    self._last_draft_probs = None
    cad = kwargs.get("common_attn_metadata")
    if cad is None:
        cad = args[5]                      # propose's positional order after k (vLLM 0.32)
    return torch.empty(cad.batch_size(), 0, dtype=torch.int64, device=self.device)


def _skip_idle_eagle() -> None:
    from vllm.v1.spec_decode.eagle import EagleProposer

    _skip_at_k0(EagleProposer, _no_model_drafts)


def _skip_off_draft_model() -> None:
    """The draft model's k = 0 pass, skipped on the steps the k controller marked drafter-off: the runner hands
    the step's mark to its drafter before proposing."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from rollout_service.speculation.k_controller import DRAFTER_OFF

    original = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if isinstance(getattr(self, "drafter", None), DraftModelProposer):
            self.drafter._rollout_off = bool(getattr(scheduler_output, DRAFTER_OFF, False))
        return original(self, scheduler_output, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    told = []

    def off(proposer) -> bool:
        if getattr(proposer, "_rollout_off", False):
            if not told:
                told.append(True)
                log.info("the k controller switched the drafter off: the draft model's pass is skipped at k = 0")
            return True
        return False

    _skip_at_k0(DraftModelProposer, _no_model_drafts, when=off)
