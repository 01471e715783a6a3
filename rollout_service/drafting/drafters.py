"""Drafters for the default model, prepared once and cached (`rollout-service prepare-drafter`).

draft_model: a 2-layer model that shares SmolLM2's tokenizer, embeddings and head, initialised from the
target's first layers and distilled (KL to the target's full next-token distribution) on the target's
own samples of the arithmetic task (rollout_tasks/arithmetic.py, the bundled trainer's): the RL domain the
drafter has to predict. `epochs=0` skips distillation (the target's first layers as they are, in seconds).
eagle3: an EAGLE-3 head trained on the target's hidden states (three layers) and next-token distributions
for the same samples (rollout_service/drafting/eagle3.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from rollout_service.models import cache_dir, save_atomically
from rollout_tasks.arithmetic import split
from rollout_tasks.chat import chat_token_ids, user_turn

log = logging.getLogger(__name__)


def default_drafter_dir(kind: str = "draft_model") -> Path:
    return cache_dir() / "drafters" / f"SmolLM2-135M-Instruct-{kind}"


def task_prompts(tokenizer, n: int, start: int = 0) -> list[list[int]]:
    """Chat-templated token ids of `n` arithmetic problems (training seeds from `start`)."""
    out = []
    for p in split(n, start=start):
        out.append(chat_token_ids(tokenizer, user_turn(p.prompt)))
    return out


def sample_target(target_dir: str, prompts: list[list[int]], max_tokens: int, temperature: float = 1.0):
    """The target's own samples (real vLLM): list of (prompt ids, generated ids)."""
    from tqdm import tqdm

    from rollout_service.config import EngineConfig
    from rollout_service.engine.types import SeqRequest
    from rollout_service.engine.vllm_engine import VllmEngine

    async def run():
        eng = VllmEngine("drafter-data", target_dir, EngineConfig(max_model_len=1024, kv_cache_gb=2))
        await eng.start()
        bar = tqdm(total=len(prompts), desc="sampling the target", unit="sample")

        async def one(i, p):
            r = await eng.generate(SeqRequest(seq_id=f"d{i}", prompt_token_ids=p, temperature=temperature,
                                              max_tokens=max_tokens, seed=i))
            bar.update()
            return r
        try:
            res = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            bar.close()
            await eng.shutdown()
        return [(p, r.token_ids) for p, r in zip(prompts, res)]
    return asyncio.run(run())


def build_student(target, layers: int):
    """A copy of `target` keeping its first `layers` decoder layers (embeddings, norm and head shared)."""
    import copy

    import torch

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    student = type(target)(config)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    student.load_state_dict(state, strict=False)
    student.tie_weights()
    for name, p in student.named_parameters():
        p.requires_grad = name.startswith("model.layers.") or name.startswith("model.norm.")
    return student.to(torch.float32)


def distill(target, student, data, *, epochs: int, lr: float, batch: int, progress: bool = True) -> list[float]:
    """Minimise KL(target || student) on the generated positions of `data`. Returns per-step losses."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    steps = epochs * ((len(data) + batch - 1) // batch)
    bar = tqdm(total=steps, desc="distilling drafter", disable=not progress)
    for _ in range(epochs):
        order = torch.randperm(len(data)).tolist()
        for b in range(0, len(order), batch):
            rows = [data[i] for i in order[b:b + batch]]
            seqs = [p + g for p, g in rows]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            attn = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.bool)     # positions whose next token was generated
            for r, ((p, g), s) in enumerate(zip(rows, seqs)):
                ids[r, :len(s)] = torch.tensor(s)
                attn[r, :len(s)] = 1
                mask[r, len(p) - 1:len(s) - 1] = True
            with torch.no_grad():
                t_logp = F.log_softmax(target(input_ids=ids, attention_mask=attn).logits[mask].float(), -1)
            s_logp = F.log_softmax(student(input_ids=ids, attention_mask=attn).logits[mask].float(), -1)
            loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
            bar.set_postfix(kl=f"{losses[-1]:.3f}")
            bar.update()
    bar.close()
    return losses


def target_samples(target_dir: str, prompts: int, max_tokens: int) -> list:
    """The target's own samples of the task, generated once with vLLM and cached beside the drafters
    (every drafter kind trains on the same samples)."""
    from transformers import AutoTokenizer

    cache = cache_dir() / "drafters" / f"{Path(target_dir).name}.samples-{prompts}x{max_tokens}.json"
    if cache.exists():
        data = [(p, g) for p, g in json.loads(cache.read_text())]
        print(f"reusing {len(data)} cached target samples from {cache}", flush=True)
        return data
    print(f"sampling {prompts} continuations of the task from the target ({target_dir}) with vLLM ...", flush=True)
    data = sample_target(target_dir, task_prompts(AutoTokenizer.from_pretrained(target_dir), prompts), max_tokens)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, cache)
    return data


def prepare_draft_model(target_dir: str, out: Path | None = None, *, layers: int = 2, prompts: int = 192,
                        max_tokens: int = 128, epochs: int = 4, lr: float = 1e-3, batch: int = 8,
                        force: bool = False) -> Path:
    out = out or default_drafter_dir("draft_model")
    if (out / "config.json").exists() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    if epochs:
        print(f"preparing a {layers}-layer drafter of {target_dir} once (distilled on its own samples; "
              f"cached in {out})", flush=True)
    tok = AutoTokenizer.from_pretrained(target_dir)
    data = target_samples(target_dir, prompts, max_tokens) if epochs else []
    torch.set_num_threads(os.cpu_count() or 1)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    student = build_student(target, layers)
    losses = distill(target, student, data, epochs=epochs, lr=lr, batch=batch) if epochs else []
    student.config.torch_dtype = torch.float32
    save_atomically(student, tok, out)
    print(f"drafter saved to {out} in {time.perf_counter() - t0:.0f} s"
          + (f" (KL first batch {losses[0]:.3f}, last {losses[-1]:.3f})" if losses else " (not distilled)"),
          flush=True)
    return out


def prepare_eagle3_head(target_dir: str, out: Path | None = None, *, prompts: int = 192, max_tokens: int = 128,
                        epochs: int = 10, force: bool = False) -> Path:
    from rollout_service.drafting.eagle3 import prepare_eagle3

    out = out or default_drafter_dir("eagle3")
    if (out / "config.json").exists() and not force:
        return out
    return prepare_eagle3(target_dir, target_samples(target_dir, prompts, max_tokens), out, epochs=epochs)
