"""vLLM's scheduler with k chosen per step by the KController (engine.speculation.k_control = "auto").

vLLM 0.32's dynamic speculative decoding (`num_speculative_tokens_per_batch_size`) looks k up per step in a dense
list, `Scheduler.dynamic_sd_lookup[batch size]`, and the worker drafts that many tokens for the next step. Here the
list is replaced by an object whose lookup asks the controller, so vLLM's own path does the rest (no padding to a
fixed k, drafters told how many to draft, k = 0 drafting nothing). A k = 0 step in a batch size where the controller
switched the drafter off carries `rollout_drafter_off` on its SchedulerOutput (a plain dataclass: the attribute
reaches the workers in-process and through the multiprocess executor's pickling), and the worker skips the
drafter's pass (speculation/k0_fastpath.py). Step times and acceptance are read in
`update_from_output`, the acceptance by each request's policy (the base, or its LoRA adapter); the lookup tells the
controller the running requests by policy, so k follows the batch's mix of adapters (one k per step: vLLM's).
Named by `scheduler_cls`, the class is built in the EngineCore process, on top of whichever scheduler vLLM chose
(the asynchronous one where async scheduling is on).

The front end reaches the controller through an EngineCore utility, `rollout_spec_control(command, arg)`:
"snapshot" returns KController.snapshot(); "drafter" n tells it the drafter changed to version n; "steps" returns
the last steps scheduled (time, batch, k, drafter off, seconds), for benchmarks and debugging.
"""
from __future__ import annotations

import collections
import os
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

from rollout_service.speculation.k_controller import (
    DRAFTER_OFF,
    KController,
    knobs_from_environment,
    policy_mix,
    request_policy,
)


TRACE_STEPS = 4096        # the recent steps kept for `rollout_spec_control("steps")` (a benchmark's, a debugger's)


class _Lookup:
    """Stands in for vLLM's dense batch size -> k list. vLLM looks k up once the step's requests are scheduled (the
    ones admitted this step already appended to `running`): the running requests are the batch's mix of policies."""

    def __init__(self, controller: KController, scheduler):
        self.controller, self.scheduler = controller, scheduler

    def __getitem__(self, batch: int) -> int:
        return self.controller.choose(batch, policy_mix(self.scheduler.running))


class _KControlled:
    """Mixed into vLLM's Scheduler or AsyncScheduler."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)       # vLLM's Scheduler or AsyncScheduler, next in the MRO
        self.k_controller = KController(self.num_spec_tokens, **knobs_from_environment(os.environ))
        # every k = 0 step with the drafter off, as if drafting lost everywhere: the losslessness check of drafts
        # made after skipped passes (tests/integration/test_speculation.py)
        self.k_controller.force_off = os.environ.get("ROLLOUT_K_CONTROL_FORCE_OFF") == "1"
        self.dynamic_sd_lookup = _Lookup(self.k_controller, self)
        self._k_steps: dict[int, tuple] = {}      # id(scheduler output) -> (scheduled at, batch, k, steady)
        self._k_last = -1
        self._k_last_done = 0.0
        # the last steps, (finished at perf_counter, batch, k, drafter off, seconds, steady): "steps" returns them
        self._k_trace: collections.deque = collections.deque(maxlen=TRACE_STEPS)

    def schedule(self, *args, **kwargs):
        t = time.perf_counter()
        out = super().schedule(*args, **kwargs)
        k = out.num_spec_tokens_to_schedule
        batch = len(out.num_scheduled_tokens)
        # the controller decided this step's k (vLLM asks it only when a sequence is scheduled)
        setattr(out, DRAFTER_OFF, batch > 0 and k == 0 and self.k_controller.last_off)
        spec = out.scheduled_spec_decode_tokens
        decode_only = batch > 0 and not out.scheduled_new_reqs and all(
            n == 1 + len(spec.get(r, ())) for r, n in out.num_scheduled_tokens.items())
        # steady: this step verifies drafts made with the same k it drafts now
        self._k_steps[id(out)] = (t, batch, k, decode_only and k == self._k_last)
        self._k_last = k
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        step = self._k_steps.pop(id(scheduler_output), None)
        now = time.perf_counter()
        if step is not None:
            t, batch, k, steady = step
            seconds = now - max(t, self._k_last_done)      # from its scheduling, or the step before it ended
            if batch:
                self._k_trace.append((now, batch, k, bool(getattr(scheduler_output, DRAFTER_OFF, False)), seconds,
                                      steady))
            if steady:
                accepted = policies = None
                if k:
                    index, sampled = model_runner_output.req_id_to_index, model_runner_output.sampled_token_ids
                    done = [r for r in scheduler_output.num_scheduled_tokens if r in index]
                    accepted = [max(0, len(sampled[index[r]]) - 1) for r in done]
                    policies = [request_policy(self.requests.get(r)) for r in done]
                self.k_controller.observe(batch, k, seconds, accepted, policies)
        self._k_last_done = now
        return super().update_from_output(scheduler_output, model_runner_output)


class _Sync(_KControlled, Scheduler):
    pass


class _Async(_KControlled, AsyncScheduler):
    pass


class KControlledScheduler:
    """What `scheduler_cls` names: builds the controlled variant of the scheduler vLLM would have used."""

    def __new__(cls, *args, vllm_config, **kwargs):
        base = _Async if vllm_config.scheduler_config.async_scheduling else _Sync
        return base(*args, vllm_config=vllm_config, **kwargs)


def rollout_spec_control(self: EngineCore, command: str, arg: int = 0):
    """EngineCore utility (see the module docstring)."""
    controller = getattr(self.scheduler, "k_controller", None)
    if controller is None:
        return None
    if command == "drafter":
        controller.drafter_changed(arg)
        return None
    if command == "snapshot":
        return controller.snapshot()
    if command == "steps":
        return [list(step) for step in self.scheduler._k_trace]
    raise ValueError(f"rollout_spec_control: unknown command {command!r}")


EngineCore.rollout_spec_control = rollout_spec_control
