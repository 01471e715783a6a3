"""EAGLE-3 heads in vLLM's format: built for a Llama-family target, trained on its hidden states, saved.

The head mirrors vLLM's `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py) exactly:
  fc(concat of the target's hidden states entering layers `aux_layers`)  -> h        (3H -> H)
  x = concat(input_layernorm(embed(next token)), hidden_norm(h))                    (2H)
  one Llama decoder layer whose q/k/v read 2H, residual h; final norm; lm_head over a draft vocabulary
  (the tokens the target actually uses on the task; `d2t` maps draft ids to target ids).
Later draft steps feed the head its own pre-norm output. Training unrolls those steps the way vLLM runs
them (training-time test): the step-s query at anchor t attends to step-1 keys up to t and to its own
chain's keys of steps 2..s, at positions t+1..t+s.
Embeddings are the target's (not saved: vLLM shares the target's embed_tokens with the head).
The training step (`features` from one forward pass of the target, `head_loss`, `train_step`) is the one both
`rollout-service prepare-drafter --kind eagle3` (offline, below) and the GRPO trainer's online adaptation
(trainer_example/drafter.py, on the features of its own training forward pass) take.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

TOPK = 32           # target distribution kept per position (renormalised over the draft vocabulary)


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default for Llama (SupportsEagle3.get_eagle3_default_aux_hidden_state_layers); models too
    shallow for it (tests' tiny ones) use the inputs of their layers. The ids are written into the head's
    config (`eagle_aux_hidden_state_layer_ids`), so vLLM taps exactly the layers the head was trained on."""
    if num_layers >= 6:
        return [2, num_layers // 2, num_layers - 3]
    return list(range(min(num_layers, 3)))


def _rms(x, w, eps):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate_half(x):
    import torch

    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def make_head(cfg, draft_vocab: list[int], embed_weight, aux_layers: list[int]):
    """An untrained head for a target with config `cfg` (defined here so importing the module is cheap)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    H = cfg.hidden_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or H // nh
    eps = cfg.rms_norm_eps
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))

    class Eagle3Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(len(aux_layers) * H, H, bias=False)
            self.hidden_norm = nn.Parameter(torch.ones(H))
            self.input_layernorm = nn.Parameter(torch.ones(H))
            self.post_attention_layernorm = nn.Parameter(torch.ones(H))
            self.norm = nn.Parameter(torch.ones(H))
            self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
            self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
            self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, H, bias=False)
            self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
            self.lm_head = nn.Linear(H, len(draft_vocab), bias=False)
            self.register_buffer("embed", embed_weight.detach().float().clone(), persistent=False)
            self.register_buffer("draft_ids", torch.tensor(draft_vocab, dtype=torch.long), persistent=False)
            inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            self.register_buffer("inv_freq", inv, persistent=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(self.embed[self.draft_ids])     # start from the target's tied head
                for lin in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj,
                            self.up_proj, self.down_proj):
                    nn.init.normal_(lin.weight, std=cfg.initializer_range)

        def _rope(self, x, pos):                        # x: (B, heads, T, hd); pos: (T,)
            ang = pos.float()[:, None] * self.inv_freq[None, :]
            emb = torch.cat([ang, ang], dim=-1)
            return x * emb.cos() + _rotate_half(x) * emb.sin()

        def unroll(self, aux, next_ids, steps: int):
            """aux: (B, T, A*H) target features at anchors t; next_ids: (B, T + steps - 1) with
            next_ids[:, t + s - 1] the token entering draft step s at anchor t. Returns per step the
            draft-vocabulary logits (B, T, Vd)."""
            B, T, _ = aux.shape
            h = self.fc(aux)
            k1 = v1 = None
            chain_k, chain_v, out = [], [], []
            causal = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()
            for s in range(1, steps + 1):
                emb = F.embedding(next_ids[:, s - 1:s - 1 + T], self.embed)
                x = torch.cat([_rms(emb, self.input_layernorm, eps), _rms(h, self.hidden_norm, eps)], -1)
                pos = torch.arange(T, device=aux.device) + s
                q = self._rope(self.q_proj(x).view(B, T, nh, hd).transpose(1, 2), pos)
                k = self._rope(self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2), pos)
                v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
                k = k.repeat_interleave(nh // nkv, dim=1)
                v = v.repeat_interleave(nh // nkv, dim=1)
                if s == 1:
                    k1, v1 = k, v
                    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    chain_k.append(k)
                    chain_v.append(v)
                    scale = 1.0 / math.sqrt(hd)
                    s1 = (q @ k1.transpose(-1, -2)) * scale
                    s1 = s1.masked_fill(~causal, float("-inf"))
                    diag = torch.stack([(q * ck).sum(-1) * scale for ck in chain_k], dim=-1)
                    p = torch.softmax(torch.cat([s1, diag], dim=-1), dim=-1)
                    att = p[..., :T] @ v1
                    for j, cv in enumerate(chain_v):
                        att = att + p[..., T + j, None] * cv
                att = att.transpose(1, 2).reshape(B, T, nh * hd)
                resid = h + self.o_proj(att)
                y = _rms(resid, self.post_attention_layernorm, eps)
                pre = resid + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
                out.append(self.lm_head(_rms(pre, self.norm, eps)))
                h = pre
            return out

        def vllm_state_dict(self) -> dict:
            sd = {"fc.weight": self.fc.weight, "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight,
                  "midlayer.hidden_norm.weight": self.hidden_norm,
                  "midlayer.input_layernorm.weight": self.input_layernorm,
                  "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm}
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                sd[f"midlayer.self_attn.{n}.weight"] = getattr(self, n).weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[f"midlayer.mlp.{n}.weight"] = getattr(self, n).weight
            sd = {k: v.detach().float().contiguous() for k, v in sd.items()}
            if len(draft_vocab) != self.embed.shape[0]:      # vLLM expects no mapping for the full vocabulary
                sd["d2t"] = self.draft_ids - torch.arange(len(draft_vocab))  # target id = draft id + d2t
            return sd

    return Eagle3Head()


def head_config(target_cfg: dict, draft_vocab_size: int, aux_layers: list[int]) -> dict:
    cfg = dict(target_cfg)
    for k in ("_model_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    cfg.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, tie_word_embeddings=False,
               draft_vocab_size=draft_vocab_size, target_hidden_size=target_cfg["hidden_size"],
               eagle_aux_hidden_state_layer_ids=list(aux_layers), num_aux_hidden_states=len(aux_layers),
               torch_dtype="float32")
    return cfg


def save_head(head, target_dir: str, out: Path, aux_layers: list[int], meta: dict) -> Path:
    """Write config.json + model.safetensors atomically (a half-written head is never picked up)."""
    import shutil

    from safetensors.torch import save_file

    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(head.vllm_state_dict(), str(tmp / "model.safetensors"))
    cfg = head_config(target_cfg, int(head.lm_head.weight.shape[0]), aux_layers)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "rollout_eagle3.json").write_text(json.dumps(meta, indent=2))
    from rollout_service.models import cache_lock, replace_dir

    with cache_lock(out):                  # atomically, never delete-then-rename (models.replace_dir)
        replace_dir(tmp, out)
    return out


def features(hidden_states, logits, input_ids, lengths, firsts, aux_layers: list[int], *,
             temperature: float = 1.0) -> list[tuple]:
    """Training features from one forward pass of the target over right-padded rows (the offline pass below and
    the trainer's own training forward share it). hidden_states: the model's `output_hidden_states` tuple, each
    (B, L, H), entry i the input of layer i; logits (B, L, V); input_ids (B, L); lengths[b] the row's tokens;
    firsts[b] its first anchor (the last prompt position). The target's distribution at `temperature` (the
    sampler's: drafts are drawn and verified at it). Per row: (aux (L, A*H) float32, tokens (L,), top-k ids (L, K),
    top-k probs (L, K), first), the top-k filled from the first anchor on (earlier positions are never scored)."""
    import torch

    out = []
    with torch.no_grad():
        for b, (L, first) in enumerate(zip(lengths, firsts)):
            L, first = int(L), int(first)
            aux = torch.cat([hidden_states[i][b, :L] for i in aux_layers], dim=-1).detach().float().clone()
            probs = torch.softmax(logits[b, first:L].detach().float() / temperature, dim=-1)
            part_p, part_i = probs.topk(TOPK, dim=-1)
            top_i = torch.zeros(L, TOPK, dtype=torch.long)
            top_p = torch.zeros(L, TOPK)
            top_i[first:], top_p[first:] = part_i, part_p
            out.append((aux, input_ids[b, :L].detach().clone(), top_i, top_p, first))
    return out


def target_features(target, data, aux_layers: list[int], *, batch: int = 4, progress: bool = True):
    """One no-grad pass of the target over (prompt, generated) samples. Per sample: (aux (L, A*H) float32,
    tokens (L,), top-k ids (L, K), top-k probs (L, K), first anchor = len(prompt) - 1)."""
    import torch
    from tqdm import tqdm

    feats = []
    bar = tqdm(total=len(data), desc="target hidden states", disable=not progress)
    for b in range(0, len(data), batch):
        for p, g in data[b:b + batch]:
            ids = torch.tensor([list(p) + list(g)])
            with torch.no_grad():
                out = target(input_ids=ids, output_hidden_states=True)
            feats += features(out.hidden_states, out.logits, ids, [ids.shape[1]], [len(p) - 1], aux_layers)
            bar.update()
    bar.close()
    return feats


def choose_draft_vocab(feats, size: int) -> list[int]:
    """The `size` target tokens carrying the most of the target's probability on the task's positions."""
    import torch

    mass = {}
    for _, _, top_i, top_p, first in feats:
        ids, ps = top_i[first:].reshape(-1), top_p[first:].reshape(-1)
        acc = torch.zeros(int(ids.max()) + 1).index_add_(0, ids, ps)
        for t in acc.nonzero().flatten().tolist():
            mass[t] = mass.get(t, 0.0) + float(acc[t])
    return sorted(sorted(mass, key=lambda t: -mass[t])[:size])


def _batch(feats, rows, steps, to_draft):
    """Right-padded tensors for draft-step training. Anchors t = first .. L-2; step s at anchor t reads
    token t+s and is scored against the target's distribution at position t+s."""
    import torch

    T = max(len(feats[r][1]) - 1 - feats[r][4] for r in rows)
    A = feats[rows[0]][0].shape[-1]
    aux = torch.zeros(len(rows), T, A)
    nxt = torch.zeros(len(rows), T + steps - 1, dtype=torch.long)
    tgt_i = torch.zeros(steps, len(rows), T, TOPK, dtype=torch.long)
    tgt_p = torch.zeros(steps, len(rows), T, TOPK)
    for r, row in enumerate(rows):
        a, ids, top_i, top_p, first = feats[row]
        L = len(ids)
        n = L - 1 - first
        aux[r, :n] = a[first:L - 1]
        tail = ids[first + 1:]
        nxt[r, :len(tail)] = tail
        for s in range(1, steps + 1):
            m = max(0, min(n, L - first - s))          # anchors whose step-s position t+s exists
            d = to_draft[top_i[first + s:first + s + m]]
            p = top_p[first + s:first + s + m] * (d >= 0)
            tgt_i[s - 1, r, :m] = d.clamp(min=0)
            tgt_p[s - 1, r, :m] = p
    return aux, nxt, tgt_i, tgt_p


def draft_index(head):
    """Target id -> draft id (-1: outside the draft vocabulary), (V,)."""
    import torch

    to_draft = torch.full((int(head.embed.shape[0]),), -1, dtype=torch.long)
    to_draft[head.draft_ids] = torch.arange(len(head.draft_ids))
    return to_draft


def head_loss(head, batch, steps: int, temperature: float = 1.0):
    """Cross-entropy of every unrolled draft step (the head's logits at `temperature`) against the target's top-k
    distribution renormalised over the draft vocabulary: forward KL up to a constant, mean over steps. `batch` is
    `_batch`'s (aux, next ids, target ids, target probs)."""
    import torch

    aux, nxt, tgt_i, tgt_p = batch
    loss = 0.0
    for s, logits in enumerate(head.unroll(aux, nxt, steps)):
        logq = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tgt_i[s])
        w = tgt_p[s]
        norm = w.sum(-1, keepdim=True).clamp(min=1e-8)
        valid = (w.sum(-1) > 0).float()
        loss = loss + (-(w / norm * logq).sum(-1) * valid).sum() / valid.sum().clamp(min=1)
    return loss / steps


def train_step(head, opt, feats, rows, *, steps: int, to_draft, temperature: float = 1.0,
               max_grad_norm: float = 1.0) -> float:
    """One optimiser step of the head on `rows` of `feats` (the one step both the offline training and the
    trainer's online adaptation take). Returns the batch's loss."""
    import torch

    loss = head_loss(head, _batch(feats, rows, steps, to_draft), steps, temperature)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], max_grad_norm)
    opt.step()
    return float(loss.detach())


def pushable_tensors(head) -> dict:
    """What an `UpdateDraft` of a served head sends (partial): its float tensors, named and shaped as in its
    model.safetensors; the draft vocabulary mapping `d2t` stays the one the service loaded."""
    return {k: v.clone() for k, v in head.vllm_state_dict().items() if k != "d2t"}


def train_head(head, feats, *, steps: int, epochs: int, lr: float, batch: int, progress: bool = True):
    """`epochs` passes of `train_step` over `feats` in random batches, AdamW with a one-cycle schedule.
    Returns per-batch losses (mean over steps)."""
    import torch
    from tqdm import tqdm

    to_draft = draft_index(head)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    n_batches = epochs * ((len(feats) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(1, n_batches), pct_start=0.1)
    losses = []
    bar = tqdm(total=n_batches, desc="training EAGLE-3 head", disable=not progress)
    for _ in range(epochs):
        order = torch.randperm(len(feats)).tolist()
        for b in range(0, len(order), batch):
            losses.append(train_step(head, opt, feats, order[b:b + batch], steps=steps, to_draft=to_draft))
            sched.step()
            bar.set_postfix(ce=f"{losses[-1]:.3f}")
            bar.update()
    bar.close()
    return losses


def step_accuracy(head, feats, steps: int, temperature: float = 1.0) -> list[float]:
    """Per draft step: the expected probabilistic-drafting acceptance sum_x min(p, q) (p the target's
    top-k renormalised on the draft vocabulary, q the head's, both at `temperature`) on `feats`: a held-out
    estimate of what vLLM will see."""
    import torch

    to_draft = draft_index(head)
    tot = [0.0] * steps
    cnt = [0.0] * steps
    with torch.no_grad():
        for b in range(0, len(feats), 8):
            aux, nxt, tgt_i, tgt_p = _batch(feats, list(range(b, min(b + 8, len(feats)))), steps, to_draft)
            for s, logits in enumerate(head.unroll(aux, nxt, steps)):
                q = torch.softmax(logits / temperature, dim=-1).gather(-1, tgt_i[s])
                w = tgt_p[s]
                valid = w.sum(-1) > 0
                tot[s] += float(torch.minimum(w, q).sum(-1)[valid].sum())
                cnt[s] += float(valid.sum())
    return [t / max(c, 1) for t, c in zip(tot, cnt)]


def prepare_eagle3(target_dir: str, data, out: Path, *, steps: int = 3, epochs: int = 6, lr: float = 2e-3,
                   batch: int = 8, draft_vocab_size: int = 4096, holdout: int = 16,
                   progress: bool = True) -> Path:
    """Train an EAGLE-3 head for `target_dir` on `data` (its own samples: (prompt ids, generated ids))."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    aux_layers = default_aux_layers(target.config.num_hidden_layers)
    feats = target_features(target, data, aux_layers, progress=progress)
    train, held = feats[holdout:], feats[:holdout]
    vocab = choose_draft_vocab(train, draft_vocab_size)
    head = make_head(target.config, vocab, target.get_input_embeddings().weight, aux_layers)
    del target
    before = step_accuracy(head, held, steps)
    losses = train_head(head, train, steps=steps, epochs=epochs, lr=lr, batch=batch, progress=progress)
    after = step_accuracy(head, held, steps)
    meta = dict(aux_layers=aux_layers, draft_vocab_size=len(vocab), train_samples=len(train),
                heldout_samples=len(held), steps=steps, epochs=epochs, lr=lr,
                heldout_acceptance_per_step_before=before, heldout_acceptance_per_step_after=after,
                loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
                seconds=time.perf_counter() - t0)
    save_head(head, target_dir, out, aux_layers, meta)
    print(f"EAGLE-3 head saved to {out} in {meta['seconds']:.0f} s: draft vocabulary {len(vocab)}, held-out "
          f"expected acceptance per draft step {' '.join(f'{a:.2f}' for a in before)} -> "
          f"{' '.join(f'{a:.2f}' for a in after)}", flush=True)
    return out


def load_head(head_dir: str | Path, target):
    """The head saved in `head_dir` (vLLM format), rebuilt as a torch module around `target`'s embeddings."""
    import torch
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    cfg = json.loads((head_dir / "config.json").read_text())
    sd = load_file(str(head_dir / "model.safetensors"))
    vocab_rows = target.get_input_embeddings().weight.shape[0]
    if "d2t" in sd:
        vocab = (torch.arange(len(sd["d2t"])) + sd["d2t"]).tolist()
    else:
        vocab = list(range(vocab_rows))
    head = make_head(target.config, vocab, target.get_input_embeddings().weight,
                     cfg["eagle_aux_hidden_state_layer_ids"])
    mine = head.vllm_state_dict()
    missing = sorted(set(mine) ^ set(sd))
    if missing:
        raise ValueError(f"{head_dir} is not an EAGLE-3 head for this target: tensors differ {missing[:6]}")
    params = dict(head.named_parameters())
    with torch.no_grad():
        for name, value in sd.items():
            if name == "d2t":
                continue
            key = name.removeprefix("midlayer.").removeprefix("self_attn.").removeprefix("mlp.")
            key = key.removesuffix(".weight") if key.endswith(("norm.weight",)) else key
            params[key].copy_(value)
    return head
