"""A speculative step's drafts come back with its samples: one round trip fewer between the engine core and its worker.

Without async scheduling (always on CPU: vLLM's CPU platform turns it off), vLLM 0.32's EngineCore.post_step asks the
worker for the step's drafts in a call of its own (`take_draft_token_ids`, a collective_rpc through the shared-memory
queues) after `sample_tokens` answered. So a speculative step costs three round trips between the two processes
(execute_model, sample_tokens, take_draft_token_ids) where a plain step costs two, at every k, and at k = 0 the third
brings back nothing; on 2 cores each round trip is a process waking from its spin and the GIL changing hands beside
the output thread. Here the worker attaches the step's drafts to the ModelRunnerOutput its sample_tokens returns
(taken by the runner's own `take_draft_token_ids`, which only reads), and the executor answers post_step's
take_draft_token_ids from them without a call. The drafts are the same lists, so what is verified and sampled does
not change (the losslessness checks cover every method).

Installed in the engine core before it starts its worker (engine/patches.py, vllm_plugin): a worker forked from the
engine core (cpu_worker_fork) inherits the worker half. Where a worker lacks it (spawned), its outputs carry no
drafts and the executor makes vLLM's call, as before; an answer is used only for the step whose samples brought it.
"""
from __future__ import annotations

ATTR = "rollout_draft_token_ids"       # on a ModelRunnerOutput: the step's DraftTokenIds (or None: no drafts)
_UNSET = object()


def install() -> bool:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.sample_tokens, "_rollout_draft_handoff", False):
        return True
    worker_sample = Worker.sample_tokens

    def sample_tokens(self, grammar_output, *args, **kwargs):
        out = worker_sample(self, grammar_output, *args, **kwargs)
        runner = self.model_runner
        if type(out) is ModelRunnerOutput and out is not EMPTY_MODEL_RUNNER_OUTPUT and \
                getattr(runner, "num_spec_tokens", 0):
            setattr(out, ATTR, runner.take_draft_token_ids())
        return out

    sample_tokens._rollout_draft_handoff = True
    Worker.sample_tokens = sample_tokens

    execute = MultiprocExecutor.execute_model
    sample = MultiprocExecutor.sample_tokens
    take = MultiprocExecutor.take_draft_token_ids

    def execute_model(self, *args, **kwargs):
        self._rollout_drafts = _UNSET           # a new step: what an earlier one brought is not this one's
        return execute(self, *args, **kwargs)

    def executor_sample_tokens(self, grammar_output, non_block: bool = False):
        out = sample(self, grammar_output, non_block=non_block)
        self._rollout_drafts = _UNSET if non_block else getattr(out, ATTR, _UNSET)
        return out

    def take_draft_token_ids(self):
        drafts, self._rollout_drafts = getattr(self, "_rollout_drafts", _UNSET), _UNSET
        return take(self) if drafts is _UNSET else drafts

    MultiprocExecutor.execute_model = execute_model
    MultiprocExecutor.sample_tokens = executor_sample_tokens
    MultiprocExecutor.take_draft_token_ids = take_draft_token_ids
    return True
