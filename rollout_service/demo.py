"""`rollout-service demo`: start the service on the default model, stream a batch of samples to the
terminal as they finish, print throughput, stop the service."""
from __future__ import annotations

import time

DEMO_PROMPTS = [
    "What is 17 + 25? Answer with the number.",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "Give a synonym for 'fast'.",
    "What is 9 times 7?",
    "Complete: The early bird ...",
    "Is 15 a prime number? Explain briefly.",
]


def run_demo(model: str, num_prompts: int, n: int, max_tokens: int) -> int:
    from rollout_client import RolloutClient
    from rollout_client.launcher import ServiceProcess

    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(num_prompts)]
    print(f"starting rollout-service on {model} (engine start takes ~40-80 s on CPU; log: rollout-demo.log)")
    t0 = time.monotonic()
    with ServiceProcess(model, log_path="rollout-demo.log") as svc:
        print(f"ready in {time.monotonic() - t0:.0f} s on {svc.target}; "
              f"generating {len(prompts)} prompts x {n} samples, up to {max_tokens} tokens, temperature 1.0")
        with RolloutClient(svc.target) as client:
            start, tokens = time.monotonic(), 0
            for s in client.generate(prompts, n=n, max_tokens=max_tokens, temperature=1.0, chat=True,
                                     return_text=True, seed=0):
                tokens += len(s.token_ids)
                text = " ".join(s.text.split())
                print(f"[p{s.prompt_index} s{s.sample_index} v{s.policy_version} {s.finish_reason:6} "
                      f"{len(s.token_ids):3d} tok, mean logp {s.logprobs.mean():6.2f}] {text[:100]}")
            wall = time.monotonic() - start
            status = client.status()
        print(f"\n{len(prompts) * n} samples, {tokens} tokens in {wall:.1f} s: {tokens / wall:.1f} tok/s "
              f"({status.samples_total} samples served, policy version {status.policy_version})")
    return 0
