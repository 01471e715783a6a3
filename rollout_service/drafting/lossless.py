"""The losslessness check: speculative generation must sample exactly the policy's distribution.

Two real vLLM engines (same model, same sampling parameters), one plain and one speculative, each draw
many short continuations of the same prompts. For every prompt and every position, a G-test of
homogeneity compares the two token histograms (categories expected fewer than 5 times are pooled);
the check fails when any p-value is below alpha / (number of tests) (Bonferroni). Then the log-probs
the speculative engine returned are compared with an independent transformers forward pass of the same
weights under the same processed distribution (temperature, top-k, top-p). With a quantized target
(engine.quantization int8) both engines serve the int8 policy and the reference is the independent int8 W8A8 forward
pass (drafting/reference.py int8_w8a8): lossless with respect to the served, quantized policy. With a LoRA adapter
(PEFT directory) both engines sample on it, the drafter drafting for the base, and the reference is the base with the
adapter merged; the speculative engine also samples every prompt without the adapter in the same batches, which the
check must reject (its power to see an adapter missing).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from rollout_service.config import LORA_RANKS, EngineConfig, LoraConfig, SpeculationConfig
from rollout_service.engine.types import SeqRequest
from rollout_service.speculation.speedup import measured_mean_acceptance_length


@dataclass
class PositionTest:
    prompt: int
    position: int
    categories: int
    g: float
    dof: int
    p: float


@dataclass
class LosslessReport:
    method: str
    samples: tuple[int, int]                           # (plain, speculative) samples compared, all prompts
    tests: list[PositionTest]
    alpha: float
    min_p: float
    acceptance_rate: float
    mean_acceptance_length: float
    logprob_max_abs_err: float
    logprob_atol: float
    passed_distribution: bool
    passed_logprobs: bool
    notes: list[str] = field(default_factory=list)
    k_steps: list[int] = field(default_factory=list)   # k_control auto: the speculative engine's steps by k drafted
    drafter_off_steps: int = 0        # k_control auto: of its k = 0 steps, those with the drafter switched off
    k_trace: list = field(default_factory=list)   # k_control auto: its last steps (VllmEngine.k_control_steps)
    k_policies: dict = field(default_factory=dict)    # k_control auto: its acceptance by policy (snapshot "policies")
    engine_failed: str = ""                            # the speculative engine crashed: nothing was compared
    power: "LosslessReport | None" = None              # check_lossless(power_temperature=...): the mismatched side
    power_adapter: "LosslessReport | None" = None      # check_lossless(adapter=...): the same prompts on the base

    @property
    def passed(self) -> bool:
        return not self.engine_failed and self.passed_distribution and self.passed_logprobs

    @property
    def completed(self) -> bool:
        """Both sides sampled and were compared (a rejection then means the distributions differ)."""
        return not self.engine_failed

    @property
    def outcome(self) -> str:
        """LOSSLESS, NOT LOSSLESS (compared and rejected) or ENGINE FAILED (nothing compared)."""
        if self.engine_failed:
            return "ENGINE FAILED"
        return "LOSSLESS" if self.passed else "NOT LOSSLESS"

    def render(self) -> str:
        lines = [f"losslessness check: speculation={self.method}, {self.samples[0]} plain and "
                 f"{self.samples[1]} speculative samples",
                 f"{'prompt':>6} {'pos':>4} {'cats':>5} {'G':>9} {'dof':>4} {'p-value':>9}"]
        for t in self.tests:
            lines.append(f"{t.prompt:>6} {t.position:>4} {t.categories:>5} {t.g:>9.2f} {t.dof:>4} {t.p:>9.4f}")
        thr = self.alpha / max(len(self.tests), 1)
        lines += [
            f"distribution: min p = {self.min_p:.3g} over {len(self.tests)} G-tests; reject below alpha/tests = "
            f"{self.alpha}/{len(self.tests)} = {thr:.2g} -> {'PASS' if self.passed_distribution else 'FAIL'}",
            f"log-probs vs independent forward pass: max |diff| = {self.logprob_max_abs_err:.2e} nats "
            f"(tolerance {self.logprob_atol:g}) -> {'PASS' if self.passed_logprobs else 'FAIL'}",
            f"acceptance rate {self.acceptance_rate:.3f}, mean acceptance length {self.mean_acceptance_length:.2f}",
            *([f"k chosen per step (auto): engine steps by k {self.k_steps}, {self.drafter_off_steps} of them with "
               "the drafter switched off"] if self.k_steps else []),
            *(["k controller's acceptance by policy (auto): " + "; ".join(
                f"{p or 'base'} {[round(a, 3) for a in row['acceptance'] if a is not None]} over "
                f"{row['sequence_steps']:.0f} sequence-steps" for p, row in sorted(self.k_policies.items()))]
              if self.k_policies else []),
            *self.notes,
            *([f"the speculative engine failed while sampling: {self.engine_failed}"] if self.engine_failed else []),
            *([f"power: the same engine, in the same batches, at another temperature against the plain samples: "
               f"min p = {self.power.min_p:.3g} -> {self.power.outcome} (it must be rejected)"] if self.power else []),
            *([f"power: the same engine, in the same batches, without the adapter against the plain samples on it: "
               f"min p = {self.power_adapter.min_p:.3g} -> "
               f"{'not rejected' if self.power_adapter.passed_distribution else 'rejected'} (it must be rejected); "
               f"their log-probs {self.power_adapter.logprob_max_abs_err:.2e} nats from the base's forward pass"]
              if self.power_adapter else []),
            f"RESULT: {self.outcome}",
        ]
        return "\n".join(lines)


def g_test(a: Counter, b: Counter) -> tuple[float, int, int, float]:
    """G-test of homogeneity of two categorical samples. Returns (G, dof, categories, p)."""
    from scipy.stats import chi2

    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0), b.get(k, 0)] for k in keys], dtype=float)
    expected_min = table.sum(1) * min(na, nb) / (na + nb)
    rare = expected_min < 5
    if rare.any():
        table = np.vstack([table[~rare], table[rare].sum(0, keepdims=True)])
        table = table[table.sum(1) > 0]
    if len(table) < 2:
        return 0.0, 0, len(table), 1.0
    col = table.sum(0, keepdims=True)
    row = table.sum(1, keepdims=True)
    exp = row * col / table.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(table > 0, table * np.log(table / exp), 0.0)
    g = 2.0 * float(terms.sum())
    dof = len(table) - 1
    return g, dof, len(table), float(chi2.sf(g, dof))


@dataclass(frozen=True)
class SampleSet:
    """n unseeded samples of every prompt under one set of sampling parameters."""
    prompts: list[list[int]]
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 10
    top_p: float = 1.0
    adapter: str = ""              # a LoRA adapter's PEFT directory every sample runs on ("": the base policy)


UPDATE_AFTER = 1 / 3           # update_draft: the share of samples finished when the new drafter is committed


async def _update_drafter(engine, path: str) -> None:
    """Commit the drafter at `path` (a directory with model.safetensors, or the file) on a generating engine as the
    service's UpdateDraft does (weights/committer.py): prepared beside the running one, then swapped in a pause in
    keep mode, so the sequences in flight go on under the new drafter."""
    from pathlib import Path

    f = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
    prepared = await engine.prepare_weights([str(f)], "drafter")
    await engine.pause("keep")
    try:
        await engine.apply_weights(prepared, [str(f)], "drafter")
        await engine.set_versions(engine.policy_version, engine.draft_version + 1)
    finally:
        await engine.resume()


async def _sample(model: str, engine_cfg: EngineConfig, sets: list[SampleSet], tag: str, env: dict | None = None,
                  update_draft: str | None = None):
    """For each set, (prompt index, SeqResult) for every sample, all from one fresh engine in the same batches;
    and the engine's k controller snapshot (None unless k_control is auto). update_draft: a drafter committed once
    UPDATE_AFTER of the samples finished, the rest in flight (each sample says which drafter version it ended with)."""
    import msgspec

    from rollout_service.engine.cpu_env import extra_environment
    from rollout_service.engine.vllm_engine import VllmEngine

    adapters = sorted({ss.adapter for ss in sets} - {""})
    if adapters:                                    # LoRA on, sized for these adapters
        engine_cfg = msgspec.structs.replace(engine_cfg, lora=LoraConfig(
            max_adapters=len(adapters), max_rank=max(lora_rank_for(a) for a in adapters)))
    lora_id = {a: i + 1 for i, a in enumerate(adapters)}
    with extra_environment(env):
        engine = VllmEngine(tag, model, engine_cfg)
        try:
            await engine.start()
            for a, i in lora_id.items():
                await engine.add_adapter(f"adapter{i}", i, a)
            seqs = [(i, p, SeqRequest(seq_id=f"{tag}-{i}-{p}-{s}", prompt_token_ids=ids, temperature=ss.temperature,
                                      top_k=ss.top_k, top_p=ss.top_p, max_tokens=ss.max_tokens, ignore_eos=True,
                                      **({"lora_name": f"adapter{lora_id[ss.adapter]}", "lora_id": lora_id[ss.adapter],
                                          "lora_path": ss.adapter} if ss.adapter else {})))
                    for i, ss in enumerate(sets) for p, ids in enumerate(ss.prompts) for s in range(ss.n)]
            tasks = [asyncio.create_task(engine.generate(q)) for _, _, q in seqs]
            if update_draft:
                pending, finished = set(tasks), 0
                while finished < UPDATE_AFTER * len(tasks):
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    finished += len(done)
                await _update_drafter(engine, update_draft)
            results = await asyncio.gather(*tasks)
            by_set = [[(p, r) for (j, p, _), r in zip(seqs, results) if j == i] for i in range(len(sets))]
            snapshot = await engine.k_control_snapshot()
            if snapshot is not None:
                snapshot["trace"] = await engine.k_control_steps()
            return by_set, snapshot
        finally:
            await engine.shutdown()


# float32: the distribution test holds in any dtype (both sides share it), but the log-prob comparison with
# the float32 reference forward pass is only exact to 2e-3 nats in float32 (bf16 engines, the "auto" choice
# on CPUs with AVX512-BF16/AMX, differ by ~0.2 nats from any float32 reference).
DEFAULT_BASE = EngineConfig(max_model_len=512, kv_cache_gb=1, max_num_seqs=64, dtype="float32")
# The log-prob tolerance by served precision: float32 as above; int8 against the independent int8 forward pass, the
# bound tests/integration/test_quantized.py holds the served int8 log-probs to (measured up to 1.7e-3 nats), or, where
# larger, INT8_SPREAD_FACTOR x the reference's own spread on the checked samples: int8 with per-token activation scales
# fixes a deep model's log-probs only to within what float32 rounding moves them (drafting/reference.py
# int8_rounding_spread; SmolLM2-135M: tenths of a nat per token), so no implementation can be held closer.
LOGPROB_ATOL = {"none": 2e-3, "int8": 5e-3}
INT8_SPREAD_FACTOR = 1.5


def lora_rank_for(adapter: str) -> int:
    """The smallest of vLLM's max_lora_rank choices that serves the PEFT adapter at `adapter`; ValueError naming
    what is wrong (no adapter_config.json, a rank above the largest)."""
    import json
    from pathlib import Path

    f = Path(adapter) / "adapter_config.json"
    try:
        r = int(json.loads(f.read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{adapter}: not a PEFT LoRA adapter directory (adapter_config.json with its rank r: "
                         f"{type(e).__name__}: {e})") from None
    fit = [x for x in LORA_RANKS if x >= r]
    if not fit:
        raise ValueError(f"{adapter}: rank {r} is above the largest LoRA rank vLLM serves ({LORA_RANKS[-1]})")
    return fit[0]


def random_adapter(model_dir: str, rank: int, out: str, *, seed: int = 0, relative: float = 1.0) -> str:
    """A PEFT LoRA adapter of `rank` on every linear layer of the model at `model_dir` (peft's all-linear), with
    random A and B scaled so that each layer's update (alpha/r) B A has `relative` of the layer's weight's Frobenius
    norm: large enough to move the distribution the check compares, on any model. Saved to `out`; returns it."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_(torch.randn(a.shape, generator=g))
            b.copy_(torch.randn(b.shape, generator=g))
            delta = module.scaling["default"] * (b @ a)
            b.mul_(relative * module.base_layer.weight.norm() / delta.norm())
    model.save_pretrained(out)
    return out


def sample_plain(model: str, prompts: list[list[int]], *, samples: int = 400, max_tokens: int = 4,
                 temperature: float = 1.0, top_k: int = 10, top_p: float = 1.0, base: EngineConfig | None = None,
                 adapter: str = ""):
    """The reference side: the same engine without speculation (reusable across several checks)."""
    return sample_plain_sets(model, [SampleSet(prompts, samples, max_tokens, temperature, top_k, top_p, adapter)],
                             base)[0]


def sample_plain_sets(model: str, sets: list[SampleSet], base: EngineConfig | None = None) -> list[list]:
    """The reference side of several checks, from one plain engine: each set as sample_plain would give it."""
    import msgspec

    cfg = msgspec.structs.replace(base or DEFAULT_BASE, speculation=SpeculationConfig())
    return asyncio.run(_sample(model, cfg, sets, "plain"))[0]


def check_lossless(model: str, spec: SpeculationConfig, prompts: list[list[int]], *, samples: int = 400,
                   max_tokens: int = 4, temperature: float = 1.0, top_k: int = 10, top_p: float = 1.0,
                   alpha: float = 1e-3, logprob_atol: float | None = None, base: EngineConfig | None = None,
                   power_temperature: float | None = None, spec_env: dict | None = None,
                   logprob_samples: int = 24, plain=None, update_draft: str | None = None,
                   adapter: str = "") -> LosslessReport:
    """`plain` reuses the output of sample_plain with the same arguments. To show the check's power: spec_env
    changes the speculative engine's environment (a fix switched off); power_temperature has the same speculative
    engine also sample every prompt at that temperature, in the same batches, and `report.power` compares those
    samples with the plain ones (it must reject them). update_draft: a drafter (in the served drafter's format)
    committed on the speculative engine mid-run, as UpdateDraft does while a trainer adapts its drafter: the samples
    before, across and after the update are all compared. base.quantization (int8): both engines serve the quantized
    policy and the log-probs are checked against its independent int8 forward pass (logprob_atol: LOGPROB_ATOL by
    precision unless given). adapter: a LoRA adapter (PEFT directory) both engines sample on, the reference being the
    base with it merged; the speculative engine also samples every prompt on the base in the same batches, and
    `report.power_adapter` compares those with the plain samples on the adapter (it must reject them)."""
    import msgspec

    quantization = (base or DEFAULT_BASE).quantization
    if logprob_atol is None:
        logprob_atol = LOGPROB_ATOL.get(quantization, LOGPROB_ATOL["none"])

    if plain is None:
        plain = sample_plain(model, prompts, samples=samples, max_tokens=max_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, base=base, adapter=adapter)
    spec_cfg = msgspec.structs.replace(base or DEFAULT_BASE, speculation=spec)
    sets = [SampleSet(prompts, samples, max_tokens, t, top_k, top_p, adapter)
            for t in ((temperature,) if power_temperature is None else (temperature, power_temperature))]
    if adapter:                  # the base in the same batches: what the check must tell from the adapter's samples
        sets.append(SampleSet(prompts, samples, max_tokens, temperature, top_k, top_p))
    try:
        spec_out, k_snapshot = asyncio.run(_sample(model, spec_cfg, sets, "spec", spec_env, update_draft))
    except Exception as e:  # noqa: BLE001 - a crashing speculative engine fails the check as its own outcome
        return LosslessReport(
            method=spec.method, samples=(len(plain), 0), tests=[], alpha=alpha, min_p=0.0, acceptance_rate=0.0,
            mean_acceptance_length=0.0, logprob_max_abs_err=float("inf"), logprob_atol=logprob_atol,
            passed_distribution=False, passed_logprobs=False, engine_failed=f"{type(e).__name__}: {e}")
    compare = dict(model=model, method=spec.method, prompts=prompts, plain=plain, max_tokens=max_tokens, top_k=top_k,
                   top_p=top_p, alpha=alpha, logprob_atol=logprob_atol, logprob_samples=logprob_samples,
                   quantization=quantization)
    report = _compare(spec_out[0], temperature, adapter=adapter, **compare)
    report.k_steps = list(k_snapshot["steps_by_k"]) if k_snapshot else []
    report.drafter_off_steps = k_snapshot.get("off_steps", 0) if k_snapshot else 0
    report.k_trace = (k_snapshot.get("trace") or []) if k_snapshot else []
    report.k_policies = k_snapshot.get("policies", {}) if k_snapshot else {}
    if update_draft:
        after = [r for _, r in spec_out[0] if r.draft_version > 0]
        report.notes.append(f"drafter updated mid-run (keep mode) from {update_draft}: {len(after)} of "
                            f"{len(spec_out[0])} samples ended under the new drafter, "
                            f"{sum(r.num_accepted for r in after)} of their drafted tokens accepted")
    if power_temperature is not None:
        report.power = _compare(spec_out[1], power_temperature, adapter=adapter, **compare)
    if adapter:
        report.power_adapter = _compare(spec_out[-1], temperature, **compare)   # log-probs: against the base
        report.notes.append(f"LoRA adapter {adapter}: both engines sample on it (the drafter drafts for the base); "
                            "log-probs against the base with it merged")
    return report


def _compare(spec_out, temperature, *, model, method, prompts, plain, max_tokens, top_k, top_p, alpha, logprob_atol,
             logprob_samples, quantization="none", adapter="") -> LosslessReport:
    """G-tests of the speculative samples against the plain ones per prompt and position, and their log-probs
    against an independent forward pass (of the served precision) at `temperature`."""
    tests = []
    for p in range(len(prompts)):
        for pos in range(max_tokens):
            a = Counter(r.token_ids[pos] for q, r in plain if q == p)
            b = Counter(r.token_ids[pos] for q, r in spec_out if q == p)
            g, dof, cats, pv = g_test(a, b)
            tests.append(PositionTest(p, pos, cats, g, dof, pv))
    min_p = min(t.p for t in tests)
    drafted_any = any(r.num_drafted for _, r in spec_out)
    drafted = sum(r.num_drafted for _, r in spec_out)
    accepted = sum(r.num_accepted for _, r in spec_out)
    steps = sum(r.spec_steps for _, r in spec_out)
    checked = spec_out[:: max(1, len(spec_out) // logprob_samples)]
    err = _logprob_error(model, prompts, checked, temperature, top_k, top_p, quantization, adapter)
    notes = []
    if quantization == "int8":
        spread = _int8_spread(model, prompts, checked, temperature, top_k, top_p)
        logprob_atol = max(logprob_atol, INT8_SPREAD_FACTOR * spread)
        to_float = _logprob_error(model, prompts, checked, temperature, top_k, top_p, "none")
        notes.append(f"int8: the reference's own spread under float32 rounding on these samples is {spread:.2e} "
                     f"nats (max per token; drafting/reference.py int8_rounding_spread): tolerance "
                     f"max({LOGPROB_ATOL['int8']:g}, {INT8_SPREAD_FACTOR:g} x spread); the float32 policy is "
                     f"{to_float:.2e} from the samples" + (" (within it: the log-prob check cannot tell int8 from "
                                                           "float32 here)" if to_float <= logprob_atol else ""))
    return LosslessReport(
        method=method, samples=(len(plain), len(spec_out)), tests=tests, alpha=alpha, min_p=min_p,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_acceptance_length=measured_mean_acceptance_length(accepted, steps),
        logprob_max_abs_err=err, logprob_atol=logprob_atol,
        passed_distribution=min_p >= alpha / len(tests), passed_logprobs=err <= logprob_atol,
        notes=([] if drafted_any else ["note: the drafter proposed nothing; this run did not exercise speculation"])
        + ([f"served precision {quantization}: both engines serve it; log-probs against its independent forward "
            "pass (drafting/reference.py int8_w8a8)"] if quantization != "none" else []) + notes,
    )


def _int8_spread(model_dir: str, prompts, outputs, temperature, top_k, top_p) -> float:
    """The largest per-token log-prob difference between the int8 reference and its equally valid variants
    (drafting/reference.py int8_rounding_spread) on `outputs`' samples."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.drafting.reference import int8_rounding_spread

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = [(prompts[p], list(r.token_ids)) for p, r in outputs]
    spread = int8_rounding_spread(model, seqs, temperature, top_k, top_p)
    return float(spread.max()) if spread.numel() else 0.0


def _logprob_error(model_dir: str, prompts, outputs, temperature, top_k, top_p, quantization: str = "none",
                   adapter: str = "") -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.drafting.reference import int8_w8a8, processed_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter:                                  # the adapter's policy: the base with the adapter merged (peft)
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    if quantization == "int8":                   # the served policy: the checkpoint as the int8 engine computes it
        model = int8_w8a8(model)
    elif quantization != "none":
        raise ValueError(f"no independent forward pass of a {quantization} policy here (int8 only)")
    worst = 0.0
    for p, r in outputs:
        ref = processed_logprobs(model, prompts[p], list(r.token_ids), temperature, top_k, top_p)
        diff = np.abs(np.asarray(r.logprobs) - ref.numpy())
        worst = max(worst, float(np.nan_to_num(diff, nan=np.inf).max()))
    return worst
