"""Python client of the rollout service (sync and asyncio)."""
from rollout_client.client import AsyncRolloutClient, RolloutClient
from rollout_client.episode import Episode, call_tools, run_episodes, run_episodes_async
from rollout_client.types import AssistantMessage, PushResult, RoutedExperts, Sample, ToolCall, build_request

__all__ = ["RolloutClient", "AsyncRolloutClient", "Sample", "RoutedExperts", "PushResult", "build_request", "Episode",
           "AssistantMessage", "ToolCall", "call_tools", "run_episodes", "run_episodes_async"]
