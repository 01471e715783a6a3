"""The event-loop lag watchdog: measures how long the loop was held, exports it, and names the code."""
import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, generate_latest

from rollout_service.server.loop_watchdog import LoopWatchdog


def hold_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)                  # a blocking call on the event loop


def test_a_held_loop_is_measured_exported_and_named(caplog):
    registry = CollectorRegistry()
    dog = LoopWatchdog(registry, interval_s=0.02, warn_s=0.1)

    async def main():
        task = asyncio.create_task(dog.run())
        await asyncio.sleep(0.2)
        assert dog.max_lag < 0.1
        hold_the_loop_for(0.4)
        await asyncio.sleep(0.1)
        task.cancel()
    with caplog.at_level(logging.WARNING, logger="rollout_service.server.loop_watchdog"):
        asyncio.run(main())
    assert 0.35 < dog.max_lag < 1.0
    text = generate_latest(registry).decode()
    assert f"rollout_event_loop_lag_max_seconds {dog.max_lag}" in text
    assert 'rollout_event_loop_lag_seconds_bucket{le="0.5"}' in text
    warnings = [r.getMessage() for r in caplog.records]
    assert any("held for" in w and "hold_the_loop_for" in w for w in warnings), warnings
