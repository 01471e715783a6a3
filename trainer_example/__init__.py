"""The bundled GRPO trainer example (uses only rollout_client to talk to the service)."""
