"""verl's agent loops on this service. verl's AgentLoopBase (SingleTurnAgentLoop, ToolAgentLoop, ...) generates
through `server_manager.generate(request_id, prompt_ids=..., sampling_params=...)`, which verl answers from vLLM
engines it starts itself (verl.workers.rollout.llm_server.LLMServerClient over its Ray server actors).
`ServerManager` answers the same call from this service's Generate instead, so verl's loops run unchanged with it
as their server_manager:

    from rollout_client.verl import ServerManager
    loop = SingleTurnAgentLoop(trainer_config=..., server_manager=ServerManager("HOST:50051", rollout_config), ...)

The sampling parameters are read as verl's vLLM server reads them (vllm_async_server.vLLMHttpServer.generate): its
`max_tokens` (or `max_new_tokens`, or the configured response length) clamped to the context, `logprobs` a flag,
top_k -1 for off. The answer is verl's TokenOutput: the sampled ids, their log-probs (the policy's processed ones),
the stop reason ("completed" or "aborted"), and in extra_fields the policy versions that produced it
(global_steps / min_global_steps / max_global_steps, what verl's fully-async trainer bounds staleness with).
verl itself is imported only for TokenOutput; this package does not depend on it.
"""
from __future__ import annotations

from typing import Any

from rollout_client.client import AsyncRolloutClient

# what verl's vLLM server passes to vLLM's SamplingParams and this service samples the same way
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids")


class ServerManager:
    """verl's server_manager, on this service's Generate. rollout_config: verl's actor_rollout_ref.rollout (its
    response_length, prompt_length, max_model_len), a dict or an omegaconf node."""

    def __init__(self, target: str, rollout_config, **client_kwargs):
        self.client = AsyncRolloutClient(target, **client_kwargs)
        get = rollout_config.get
        self.response_length = int(get("response_length"))
        self.prompt_length = int(get("prompt_length"))
        self.max_model_len = int(get("max_model_len") or self.prompt_length + self.response_length)

    def max_tokens(self, sampling_params: dict, prompt_len: int) -> int:
        """vLLMHttpServer.generate's rule: the request's bound, else the response budget, within the context."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt_ids: {prompt_len} tokens leave no room to generate within the context length "
                             f"{self.max_model_len}")
        if "max_tokens" in sampling_params:
            wanted = sampling_params["max_tokens"]
        elif "max_new_tokens" in sampling_params:
            wanted = sampling_params["max_new_tokens"]
        else:
            wanted = min(self.response_length, self.prompt_length + self.response_length - prompt_len)
        return max(1, min(int(wanted), room))

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, audio_data=None, **kwargs):
        """One sample of `prompt_ids` -> verl's TokenOutput. request_id: verl's sticky-session key (one per
        trajectory): this service's session_id, so a multi-turn trajectory's turns reuse one engine's cache."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("image_data / video_data / audio_data: multimodal prompts are not served")
        sp = dict(sampling_params)
        if sp.get("repetition_penalty", 1.0) != 1.0:
            raise ValueError("sampling_params.repetition_penalty: penalties change the sampled distribution away "
                             "from the policy's; this service samples the policy only (leave it at 1.0)")
        want_logprobs = bool(sp.get("logprobs", False))
        request = {k: sp[k] for k in _SAMPLING if sp.get(k) is not None}
        if request.get("top_k") == -1:
            request["top_k"] = 0                      # vLLM's -1 (off) is the contract's 0
        ids = [int(t) for t in prompt_ids]
        samples = await self.client.generate_all([ids], max_tokens=self.max_tokens(sp, len(ids)),
                                                 session_id=str(request_id)[:256], return_partial=True, **request)
        s = samples[0][0]
        versions = [v for v, _ in s.version_spans] or [s.policy_version]
        return TokenOutput(token_ids=s.token_ids.tolist(),
                           log_probs=s.logprobs.tolist() if want_logprobs else None,
                           stop_reason="aborted" if s.finish_reason == "abort" else "completed",
                           extra_fields={"global_steps": versions[-1], "min_global_steps": min(versions),
                                         "max_global_steps": max(versions)})

    async def close(self) -> None:
        await self.client.close()
