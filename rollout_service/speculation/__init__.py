"""Speculative decoding while serving: the k controller and its vLLM scheduler, the CPU sampling fix, the k = 0
fast path, the speedup arithmetic. Offline drafter tooling is in rollout_service/drafting/."""
