"""Python client of the rollout service (sync and asyncio)."""
from rollout_client.client import AsyncRolloutClient, RolloutClient
from rollout_client.types import PushResult, RoutedExperts, Sample, build_request

__all__ = ["RolloutClient", "AsyncRolloutClient", "Sample", "RoutedExperts", "PushResult", "build_request"]
