"""An open performance model: project rollouts and RL steps onto GPUs from what this machine measures.

One noun per file, read in this order:
    hardware.py    what a device can do (profiles: this CPU as calibrated, H100 SXM, GB200)
    model.py       what a transformer moves and computes per step (from its Hugging Face config.json)
    step.py        one engine step: roofline time of a plain or speculative step
    rollout.py     a rollout batch: throughput and speedup by concurrency and k, the batch draining
    rl.py          an RL step: sync or async, speculation on or off
    acceptance.py  per-position acceptance: typed, from GetStatus or from a trainer's metrics.jsonl
    report.py      table, JSON and plots
    simulate.py    `rollout-service simulate`
Pure Python; nothing here imports vLLM or torch.
"""
