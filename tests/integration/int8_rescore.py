"""Sampled sequences re-scored by an independent plain int8 engine: a fresh vLLM engine (its own process, no worker
extension, none of the service's patches) loads the int8 W8A8 checkpoint of a float checkpoint (engine/quantize.py
write_checkpoint, as a service writes at start-up) and prefills prompt + completion with prompt_logprobs: each
completion token's log-prob under that engine's int8 policy (raw log-softmax: the served log-probs at temperature 1,
no top-k or top-p).

    rescore(float_dir, [(prompt_ids, completion_ids), ...], workdir) -> [np.ndarray of completion log-probs, ...]

The engine runs in a child process (`python -m tests.integration.int8_rescore REQUEST.json RESULT.json`), so its
processes and memory end with it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rescore(float_dir: str | Path, sequences: list[tuple[list[int], list[int]]], workdir: str | Path,
            timeout: float = 600) -> list:
    import numpy as np

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    request, result = workdir / "rescore_request.json", workdir / "rescore_result.json"
    request.write_text(json.dumps({"model": str(float_dir), "int8_dir": str(workdir / "int8"),
                                   "sequences": [[list(map(int, p)), list(map(int, c))] for p, c in sequences]}))
    r = subprocess.run([sys.executable, "-m", "tests.integration.int8_rescore", str(request), str(result)],
                       cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"the independent int8 engine failed (exit {r.returncode}):\n{r.stderr[-4000:]}"
    return [np.asarray(x, dtype=np.float64) for x in json.loads(result.read_text())["logprobs"]]


def main(request_path: str, result_path: str) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from rollout_service.engine.cpu_env import is_cpu_platform, prepare_cpu_environment
    from rollout_service.engine.quantize import write_checkpoint

    req = json.loads(Path(request_path).read_text())
    int8_dir = write_checkpoint(req["model"], req["int8_dir"])
    extra = {}
    if is_cpu_platform():           # the service's CPU settings: KV cache size, OpenMP binding; whole prefills
        prepare_cpu_environment()
        extra = dict(enable_chunked_prefill=False, max_num_batched_tokens=2048, kv_cache_memory_bytes=2**30)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(int8_dir), dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
              max_num_seqs=16, **extra)
    seqs = req["sequences"]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in seqs],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
    found = []
    for (p, c), out in zip(seqs, outs, strict=True):
        rows = out.prompt_logprobs[len(p):]            # entry i: the log-prob of token i given the tokens before it
        found.append([row[t].logprob for row, t in zip(rows, c, strict=True)])
    Path(result_path).write_text(json.dumps({"logprobs": found}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
