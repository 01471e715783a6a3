"""Offline drafter tooling, apart from what runs while serving: preparing drafters (a distilled draft model, an
EAGLE-3 head) and the losslessness check with its independent reference forward pass. Nothing here is imported
by the running service."""
