"""An open performance model: project rollouts and RL steps onto GPUs from what this machine measures.

One noun per file, read in this order:
    hardware.py    what a device can do (profiles: this CPU as calibrated, H100 SXM, H200 SXM, B200, GB200; the GPU
                   step form's constants, fitted to measured H200 steps)
    model.py       what a transformer moves and computes per step (from its Hugging Face config.json)
    moe.py         mixtures of experts: experts read per step, expert parallelism's busiest device, the all-to-all
    step.py        one engine step: the time of a plain or speculative step (GPUs: the fitted form; CPU: the
                   calibrated roofline); single step times (simulate --step-table)
    fit.py         a GPU profile fitted to a perf/gpu_step_probe.py file (simulate --hardware-from)
    rollout.py     a rollout batch: throughput and speedup by concurrency and k, the batch draining
    rl.py          an RL step: sync or async, speculation on or off
    weight_sync.py a weight push whole or as a delta (changed elements only), over a link; its share of the step
    acceptance.py  per-position acceptance: typed, from GetStatus or from a trainer's metrics.jsonl
    report.py      table, JSON and plots
    simulate.py    `rollout-service simulate`
Pure Python (fit.py: scipy); nothing here imports vLLM or torch.
"""
