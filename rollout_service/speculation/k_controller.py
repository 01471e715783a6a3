"""Choose k (drafts per sequence, 0 to k_max) for every engine step, from what the engine measures while it serves.

Pure bookkeeping, no vLLM: the engine's scheduler (speculation/k_scheduler.py) asks `choose(batch)` each step and
reports every finished step with `observe(...)`. Two things are measured:

- the step time T(b, k) by batch-size bucket (1, 2, 3-4, 5-8, ...) and k, an exponential moving average over
  pure decode steps that verified the drafts of the same k they drafted (the first step after a switch mixes two
  ks and is not counted; prefill steps are not counted), compared at the bucket's largest batch (a bucket spans
  2x in batch, and a draining batch times its ks at different sizes: `seconds`); a k > 0 is timed against k = 0
  next to it in time, as the median of paired ratios T(k)/T(0) from the steps either side of each switch of k
  (`_pair`), since the machine's speed moves more between minutes, and in bursts of slow steps, than drafting costs;
- the per-position acceptance a_i of the drafter in use: of the sequence-steps that reached draft position i
  (every earlier draft accepted), the fraction that accepted it. A sequence the drafter proposed nothing for
  (n-gram without a match) counts as rejected. Acceptance does not depend on the batch, so every bucket shares it.
  It is forgotten when the drafter changes (`drafter_changed`) and decays so that it follows the moving policy.
  It is kept per policy too: the base, and each LoRA adapter by name (`policy_of`: a drafter drafts for the base, so
  an adapter's policy may accept its drafts more or less often). A policy's own estimate starts at the pooled one
  (PRIOR pseudo-observations of it) and moves to its own counts as they come.

Expected tokens per sequence-step at k is L(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k, so the controller picks
argmax_k L(k) / T(b, k): k = 0 (no drafting, L = 1) wherever verifying costs more than the drafts bring in. k = 0
is the safe choice, so drafting must beat it by `margin`. vLLM 0.32 takes one k per step for the whole batch
(SchedulerOutput.num_spec_tokens_to_schedule), so with adapters L(k) is the mean of the policies' own L(k) over the
batch's sequences (`choose(batch, mix)`: the running requests by policy). A decision holds for `dwell` steps of the
same bucket while the batch's set of policies stays the same.

Measuring costs throughput, and this machine drifts (up to 3x in a day), so:
- a bucket's cells are measured in the order k = 0, 1, 2, ...; a deeper k is measured only while the one before
  reaches `deepen` of k = 0's rate, nor before the acceptance is known (a k > 1 step where verifying is dear costs
  2-3 plain steps, and n-gram's acceptance is often too low to pay for any of them; with 0.7, suffix decoding
  measured k = 2 and 3 at break-even batch sizes that a drain visits for a few dozen steps, and lost 7-12% at
  32 sequences where its k = 0 steps were at parity);
- while drafting, k = 0 is re-measured every `refresh_every` decisions of that bucket, so the comparison is made
  against a reference of the same hour, not of the morning;
- a neighbour of the best k is re-tried every `explore_every` decisions, eight times less often when it looked
  clearly worse (below `give_up` of the best k's rate; where k = 0 is the best, below `deepen`: a draft model at
  4 sequences, k = 1 at 0.74-0.81 of k = 0, spent 2-3% of its steps re-trying k = 1 at 1.5x a step's time and
  lost 3-4% to plain where the same engine without re-tries lost 1%);
- a cell starts from the median of its first `min_obs` steps (an engine's first steps, a warm-up or a stall, are
  often 10x slow: taken as the start of an average that moves 10% per step, one such step made k = 0 look 14x
  dearer than it was at one sequence for the rest of a run), and after that one step's time moves it by at most
  a factor 2 (a stall or a collection does not redefine it);
- a cell not observed for `stale_s` of engine time (the sum of the steps' times) is re-measured afresh, from the
  median of its next `min_obs` steps, keeping its old value meanwhile: a moving average that blends steps from
  either side of a gap compares a cell of this minute with one of a minute the machine ran at another speed (n-gram,
  drafting with first-draft acceptance 0.055, drafted at 5-8 sequences because k = 1 timed at 38 ms in recent
  drains against a k = 0 at 47 ms from earlier, and lost 4-7% at 4-32 sequences);
- without measured acceptance (at start, after a new drafter), the cheapest k > 0 drafts until it is measured.

Where drafting loses (the acceptance measured, k = 0 and k = 1 measured in a bucket, and k = 0 the best), the
controller switches the drafter off for that bucket: its k = 0 decisions say so (`last_off`), the scheduler marks
the step, and the worker then runs nothing of the drafter, not even the draft model's pass that keeps its KV cache
in step with the target's (speculation/k0_fastpath.py). k = 0 chosen to measure or to refresh the reference while
drafting pays keeps that pass. An off bucket still re-tries k = 1 as exploration does (eight times less often unless
it nearly paid), so it turns back on when drafting starts to pay; a draft model's drafts there are made
from a KV cache with gaps, which the acceptance it then measures includes.
"""
from __future__ import annotations

import collections
import random
import statistics
from dataclasses import dataclass, field

DRAFTER_OFF = "rollout_drafter_off"     # SchedulerOutput attribute: k = 0 with the drafter switched off (k0_fastpath)
PAIR_STEPS = 8      # the steps either side of a switch of k that one paired ratio compares
PAIRS = 6           # the paired ratios a cell keeps (their median is its T(k)/T(0))
BASE_POLICY = ""    # the base policy's key in the per-policy acceptance (requests without a LoRA adapter)
PRIOR = 8.0         # pseudo-observations of the pooled acceptance a policy's own estimate starts from
MAX_POLICIES = 64   # policies whose acceptance is kept (the least recently observed one is forgotten)


def policy_of(lora_name: str | None) -> str:
    """A request's vLLM LoRA name -> its policy key: the adapter's name without the service's version suffix
    (`name@vN`, pool/adapters.py), so its acceptance follows the adapter across versions as the base's follows
    pushes of the base; BASE_POLICY for a request without an adapter."""
    if not lora_name:
        return BASE_POLICY
    name, sep, version = lora_name.rpartition("@v")
    return name if sep and version.isdigit() else lora_name


def request_policy(request) -> str:
    """A vLLM request (its .lora_request, None without an adapter) -> its policy key (None: the base's)."""
    lora = getattr(request, "lora_request", None)
    return policy_of(lora.lora_name if lora is not None else None)


def policy_mix(requests) -> dict[str, int]:
    """vLLM requests -> sequences by policy key."""
    mix: dict[str, int] = {}
    for r in requests:
        key = request_policy(r)
        mix[key] = mix.get(key, 0) + 1
    return mix


# The controller's settings for benchmarks and debugging, from the engine's environment (defaults: KController's):
# how much drafting must beat k = 0 by; the share of k = 0's rate a k must reach for the next deeper one to be
# measured; every how many decisions a neighbour of the best k is re-tried; the longest gap of engine time across
# which a switch of k is paired (0: none, each cell's own average as before paired ratios)
KNOBS = {"margin": ("ROLLOUT_K_CONTROL_MARGIN", float, 0), "deepen": ("ROLLOUT_K_CONTROL_DEEPEN", float, 0),
         "explore_every": ("ROLLOUT_K_CONTROL_EXPLORE_EVERY", int, 1), "pair_s": ("ROLLOUT_K_CONTROL_PAIR_S", float, 0)}


def knobs_from_environment(environ) -> dict:
    """KController's keyword arguments set in `environ` (an engine's environment); ValueError names a bad one."""
    knobs = {}
    for name, (var, cast, least) in KNOBS.items():
        raw = environ.get(var)
        if raw:
            try:
                knobs[name] = cast(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r}: not a{'n' if cast is int else ''} {cast.__name__}") from None
            if knobs[name] < least:
                raise ValueError(f"{var}={raw!r}: must be >= {least}")
    return knobs


def bucket_of(batch: int) -> int:
    """Batch size -> bucket index: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, ..."""
    return max(0, (max(1, batch) - 1).bit_length())


def bucket_name(bucket: int) -> str:
    lo, hi = (1 << (bucket - 1)) + 1 if bucket else 1, 1 << bucket
    return str(lo) if lo == hi else f"{lo}-{hi}"


@dataclass
class Cell:
    """One (bucket, k): step time (seconds), tokens per sequence-step and the batch size it was measured at, as
    exponential moving averages that start from the first observations' median (seconds) and mean (the others)."""
    seconds: float = 0.0
    tokens: float = 1.0
    batch: float = 1.0
    n: int = 0
    first: list = field(default_factory=list)       # (seconds, tokens, batch) of the first (or fresh) min_obs steps
    at: float = 0.0                                 # the controller's clock at its last observation
    ratios: collections.deque = field(default_factory=lambda: collections.deque(maxlen=PAIRS))   # k > 0: T(k)/T(0)


@dataclass
class Acceptance:
    """Per-position counts of one drafter's drafts (pooled, or one policy's): reached[i], sequence-steps that reached
    draft position i (1-based, every earlier draft accepted), and accepted[i], those that accepted it."""
    k_max: int
    reached: list = field(default_factory=list)
    accepted: list = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0.0] * (self.k_max + 1)
        self.accepted = self.accepted or [0.0] * (self.k_max + 1)

    def add(self, j: int, k: int, window: float) -> None:
        """One sequence-step that drafted k and accepted j of them."""
        for i in range(1, min(j + 1, k) + 1):          # positions 1..j accepted, j + 1 (if <= k) rejected
            self.reached[i] += 1
            if i <= j:
                self.accepted[i] += 1
        if self.reached[1] > window:                    # forget slowly: follow a moving policy
            self.reached = [x / 2 for x in self.reached]
            self.accepted = [x / 2 for x in self.accepted]


@dataclass
class Run:
    """A bucket's consecutive observed steps of one k: (clock, seconds, batch) of its first and of its last PAIR_STEPS
    steps (a run off for minutes keeps only its ends), and whether its first steps were paired yet."""
    k: int
    head: list = field(default_factory=list)
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=PAIR_STEPS))
    paired: bool = False


class KController:
    def __init__(self, k_max: int, *, dwell: int = 8, min_obs: int = 6, explore_every: int = 40,
                 refresh_every: int = 12, margin: float = 0.04, give_up: float = 0.7, deepen: float = 0.9,
                 alpha: float = 0.1, stale_s: float = 10.0, pair_s: float = 2.0,
                 window: float = 4000.0, min_sequences: int = 32, seed: int = 0):
        if k_max < 1:
            raise ValueError("k_max must be >= 1")
        self.k_max, self.dwell, self.min_obs, self.explore_every = k_max, dwell, min_obs, explore_every
        self.alpha, self.window, self.min_sequences = alpha, window, min_sequences
        self.stale_s, self.pair_s = stale_s, pair_s
        self._runs: dict[int, collections.deque] = {}    # bucket -> its last two runs (the current one last)
        self.clock = 0.0                       # engine time: the sum of the observed steps' seconds
        self.refresh_every, self.margin, self.give_up, self.deepen = refresh_every, margin, give_up, deepen
        self._since_zero: dict[int, int] = {}            # bucket -> decisions since it last ran k = 0
        self.rng = random.Random(seed)
        self.cells: dict[tuple[int, int], Cell] = {}
        self.pooled = Acceptance(k_max)        # every policy's sequence-steps together
        self.by_policy: collections.OrderedDict[str, Acceptance] = collections.OrderedDict()   # the last observed last
        self.draft_version = 0
        self.bucket_steps: dict[int, list[int]] = {}     # bucket -> steps scheduled there, by the k they drafted
        self.decisions = 0
        # bucket -> (k, steps left, drafter off, the batch's policies it was decided for)
        self._current: dict[int, tuple[int, int, bool, frozenset | None]] = {}
        self.last_off = False                  # the last choose(): k = 0 with the drafter switched off
        self.off_steps = 0                     # steps scheduled with the drafter switched off
        self.force_off = False                 # every k = 0 decision switches the drafter off (a test's setting)

    # ---- what the scheduler calls ---------------------------------------------------------------------------
    def choose(self, batch: int, mix: dict[str, int] | None = None) -> int:
        """k for a step of `batch` sequences; mix: the batch's sequences by policy (None: as the pooled acceptance)."""
        b = bucket_of(batch)
        policies = frozenset(mix) if mix else None
        k, left, off, decided_for = self._current.get(b, (-1, 0, False, None))
        if left <= 0 or decided_for != policies:
            k = self._decide(b, mix)
            left, off = self.dwell, k == 0 and (self.force_off or self.off(b, mix))
        self._current[b] = (k, left - 1, off, policies)
        self.bucket_steps.setdefault(b, [0] * (self.k_max + 1))[k] += 1
        self.last_off = off
        self.off_steps += off
        return k

    def observe(self, batch: int, k: int, seconds: float, accepted_counts: list[int] | None = None,
                policies: list[str] | None = None) -> None:
        """A finished pure-decode step that verified k drafts per sequence and drafted k again: its time, and per
        sequence the number of drafts accepted (None or [] when k = 0) and its policy (`policy_of`; None: all the
        base policy's)."""
        cell = self.cells.setdefault((bucket_of(batch), k), Cell())
        tokens = 1 + sum(accepted_counts) / len(accepted_counts) if k and accepted_counts else 1.0
        stale = cell.n >= self.min_obs and self.clock - cell.at > self.stale_s
        self.clock += seconds
        if stale:
            cell.first = [(seconds, tokens, batch)]      # stale: re-measured afresh, its old value kept meanwhile
        elif cell.n < self.min_obs or cell.first:
            cell.first.append((seconds, tokens, batch))
        if cell.first:
            if cell.n < self.min_obs or len(cell.first) == self.min_obs:
                cell.seconds = statistics.median(s for s, _, _ in cell.first)
                cell.tokens = statistics.fmean(t for _, t, _ in cell.first)
                cell.batch = statistics.fmean(x for _, _, x in cell.first)
            if len(cell.first) == self.min_obs:
                cell.first = []
        else:
            seconds = min(max(seconds, cell.seconds / 2), cell.seconds * 2)
            cell.seconds += self.alpha * (seconds - cell.seconds)
            cell.tokens += self.alpha * (tokens - cell.tokens)
            cell.batch += self.alpha * (batch - cell.batch)
        cell.n += 1
        cell.at = self.clock
        self._follow_run(bucket_of(batch), k, seconds, batch)
        if k and accepted_counts:
            for n, j in enumerate(accepted_counts):
                self.pooled.add(j, k, self.window)
                self._policy(policies[n] if policies else BASE_POLICY).add(j, k, self.window)

    def _policy(self, key: str) -> Acceptance:
        own = self.by_policy.get(key)
        if own is None:
            own = self.by_policy[key] = Acceptance(self.k_max)
            while len(self.by_policy) > MAX_POLICIES:
                self.by_policy.popitem(last=False)
        self.by_policy.move_to_end(key)
        return own

    def _follow_run(self, b: int, k: int, seconds: float, batch: int) -> None:
        runs = self._runs.setdefault(b, collections.deque(maxlen=2))
        if not runs or runs[-1].k != k:
            if runs and not runs[-1].paired:
                self._pair(b)                            # a run that ended before PAIR_STEPS steps
            runs.append(Run(k))
        run = runs[-1]
        if len(run.head) < PAIR_STEPS:
            run.head.append((self.clock, seconds, batch))
        run.tail.append((self.clock, seconds, batch))
        if len(run.head) == PAIR_STEPS and not run.paired:
            self._pair(b)

    def _pair(self, b: int) -> None:
        """The bucket's current run has its first steps: if the run before it (another k) ended just before, one
        paired ratio T(k)/T(0) from the steps either side of the switch (at most PAIR_STEPS each, at the bucket's
        largest batch), for the new run's k, or the old one's where the new one is k = 0; a switch between two
        ks > 0 chains through the one whose ratio is known. Steps next to each other in time see the machine at one
        speed: a k = 0 cell that averaged in a burst of slow steps (k = 0 at 4 sequences took 41-50 ms for 11 steps
        of a drain, 28-30 ms before and after) does not make drafting look cheap, nor one timed in another phase."""
        runs = self._runs[b]
        run = runs[-1]
        run.paired = True
        if len(runs) < 2:
            return
        before = runs[0].tail
        if min(len(before), len(run.head)) < 3 or run.head[0][0] - before[-1][0] > self.pair_s:
            return
        old, new = runs[0].k, run.k
        times = {k: statistics.median(self._at_top(b, s, x) for _, s, x in side)
                 for k, side in ((old, before), (new, run.head))}
        known = {k: self._relative(b, k) for k in times}
        # the k this pair measures: the new run's against the old one where the old one's ratio is known (k = 0's
        # always is), else the old run's against the new one
        k, ref = (new, old) if new and known[old] is not None else (old, new)
        if k and known[ref] is not None:
            self.cells[(b, k)].ratios.append(times[k] / times[ref] * known[ref])

    def _relative(self, b: int, k: int) -> float | None:
        """T(b, k)/T(b, 0) from the paired ratios (1 for k = 0; None before any)."""
        if not k:
            return 1.0
        ratios = self.cells[(b, k)].ratios
        return statistics.median(ratios) if ratios else None

    def drafter_changed(self, version: int) -> None:
        """A new drafter: its acceptance is unknown until measured (step times still hold)."""
        self.draft_version = version
        self.pooled = Acceptance(self.k_max)
        self.by_policy.clear()
        self._current.clear()

    # ---- the model ------------------------------------------------------------------------------------------
    def acceptance_known(self) -> bool:
        """Enough sequence-steps drafted, over all policies (a policy's own estimate starts from the pooled one)."""
        return self.pooled.reached[1] >= self.min_sequences

    def acceptance(self, policy: str | None = None) -> list[float | None]:
        """a_1..a_k_max, smoothed toward 1/2 by one pseudo-observation (a position nobody reached, behind one
        that is rarely accepted, adds almost nothing either way); None until enough sequence-steps drafted.
        policy: that policy's own estimate, its counts added to PRIOR pseudo-observations of the pooled one."""
        if not self.acceptance_known():
            return [None] * self.k_max
        pooled = [(self.pooled.accepted[i] + 0.5) / (self.pooled.reached[i] + 1) for i in range(1, self.k_max + 1)]
        own = self.by_policy.get(policy) if policy is not None else None
        if own is None:
            return pooled
        return [(own.accepted[i] + PRIOR * a) / (own.reached[i] + PRIOR) for i, a in enumerate(pooled, 1)]

    def mean_length(self, k: int, mix: dict[str, int] | None = None) -> float | None:
        """L(k) = 1 + a_1 + a_1 a_2 + ...; None while the acceptance is unmeasured. mix (sequences by policy): the
        mean of each policy's own L(k) over the batch's sequences."""
        if k and not self.acceptance_known():
            return None
        if mix:
            total = sum(mix.values())
            return sum(n * self._length(k, self.acceptance(p)) for p, n in mix.items()) / total
        return self._length(k, self.acceptance())

    @staticmethod
    def _length(k: int, acceptance: list) -> float:
        total, prod = 1.0, 1.0
        for a in acceptance[:k]:
            prod *= a
            total += prod
        return total

    def _measured(self, b: int, k: int) -> Cell | None:
        cell = self.cells.get((b, k))
        return cell if cell is not None and cell.n >= self.min_obs and cell.seconds > 0 else None

    def seconds(self, b: int, k: int) -> float | None:
        """Cell (b, k)'s step time at the bucket's largest batch, so that cells measured at different batch sizes
        compare (a bucket spans 2x: n-gram at 33-64 sequences timed k = 0 at 188 ms, mostly at 64 sequences, and
        k = 2 at 153 ms while the batch drained to the 30s, and drafted where it lost). The step time is taken as
        linear in the batch, p + q b, through the k = 0 cells of this bucket and the nearest measured one (below
        if there is one), with q between 0 (flat: no correction) and proportional to the batch.
        A k > 0 cell with paired ratios (`_pair`) is k = 0's time times their median: drafting is compared with
        k = 0 next to it in time, not with an average of other minutes."""
        cell = self._measured(b, k)
        if cell is None:
            return None
        zero = self.seconds(b, 0) if k and cell.ratios else None
        if zero is not None:
            return zero * self._relative(b, k)
        return self._at_top(b, cell.seconds, cell.batch)

    def _at_top(self, b: int, seconds: float, batch: float) -> float:
        """A step time at `batch` scaled to bucket b's largest batch along the k = 0 line (see seconds())."""
        own = self._measured(b, 0)
        nearest = (self._measured(o, 0) for o in (*range(b - 1, -1, -1), *range(b + 1, b + 32)))   # below first
        other = next((c for c in nearest if c and abs(c.batch - own.batch) >= 1), None) if own else None
        if other is None:
            return seconds
        q = min(max((own.seconds - other.seconds) / (own.batch - other.batch), 0.0), own.seconds / own.batch)
        p = own.seconds - q * own.batch
        return seconds * (p + q * (1 << b)) / (p + q * batch)

    def rate(self, b: int, k: int, mix: dict[str, int] | None = None) -> float | None:
        """Expected tokens per sequence per second at bucket b and k for a batch of `mix` (None: not measured
        enough)."""
        seconds, length = self.seconds(b, k), self.mean_length(k, mix)
        return None if seconds is None or length is None else length / seconds

    def _decide(self, b: int, mix: dict[str, int] | None = None) -> int:
        self.decisions += 1
        k = self._pick(b, mix)
        self._since_zero[b] = 0 if k == 0 else self._since_zero.get(b, 0) + 1
        return k

    def _pick(self, b: int, mix: dict[str, int] | None = None) -> int:
        for k in range(self.k_max + 1):                  # measure k = 0, 1, ... while the last one nearly pays
            if self._measured(b, k) is None:
                return k
            ratio = self._ratio(b, k, mix=mix)
            if k and (ratio is None or ratio < self.deepen):
                break                                    # worse, or not comparable until acceptance is known
        if not self.acceptance_known():                  # draft with the cheapest k > 0 until acceptance is known
            return min(range(1, self.k_max + 1), key=lambda k: self.seconds(b, k) or float("inf"))
        best = self.best(b, mix)
        if best and self._since_zero.get(b, 0) >= self.refresh_every:
            return 0                                     # keep the reference fresh
        if self.decisions % self.explore_every == 0:
            k = self.rng.choice([k for k in (best - 1, best + 1) if 0 <= k <= self.k_max])
            ratio = self._ratio(b, k, against=best, mix=mix)
            # where nothing drafts, a re-try is pure cost until drafting pays: it must nearly pay to come often
            worse = self.deepen if best == 0 else self.give_up
            if ratio is None or ratio >= worse or self.decisions % (8 * self.explore_every) == 0:
                return k
        return best

    def off(self, b: int, mix: dict[str, int] | None = None) -> bool:
        """Drafting loses at bucket b (for a batch of `mix`): with the acceptance known and k = 0 and k = 1 measured,
        k = 0 is the best."""
        return all(self._measured(b, k) for k in (0, 1)) and self.acceptance_known() and self.best(b, mix) == 0

    def _ratio(self, b: int, k: int, against: int = 0, mix: dict[str, int] | None = None) -> float | None:
        r, ref = self.rate(b, k, mix), self.rate(b, against, mix)
        return r / ref if r is not None and ref else None

    def best(self, b: int, mix: dict[str, int] | None = None) -> int:
        rates = {k: self.rate(b, k, mix) for k in range(self.k_max + 1)}
        known = {k: r for k, r in rates.items() if r is not None}
        if not known:
            return 0
        best = max(known, key=known.get)
        if best and 0 in known and known[best] < known[0] * (1 + self.margin):
            return 0                                     # drafting must clearly pay
        return best

    # ---- reporting ------------------------------------------------------------------------------------------
    @property
    def steps_by_k(self) -> list[int]:
        """Every step scheduled, by the k it drafted (all buckets)."""
        return [sum(col) for col in zip(*self.bucket_steps.values())] or [0] * (self.k_max + 1)

    def snapshot(self) -> dict:
        """Plain data (it crosses a process boundary as msgpack): what GetStatus and /metrics show."""
        buckets = sorted({b for b, _ in self.cells} | set(self.bucket_steps))
        adapters = list(self.by_policy) if set(self.by_policy) - {BASE_POLICY} else []
        rows = []
        for b in buckets:
            best = self.best(b)
            plain, best_s, chosen = self.seconds(b, 0), self.seconds(b, best), self.rate(b, best)
            cell = self.cells.get((b, best))
            measured = plain is not None and best_s is not None
            rows.append({
                "batch": bucket_name(b), "chosen_k": best, "drafter_off": self.off(b),
                "steps_by_k": list(self.bucket_steps.get(b, [0] * (self.k_max + 1))),
                # at the bucket's largest batch (see seconds()); a cell still being measured: as measured so far
                "step_ms": [round((self.seconds(b, k) or self.cells[(b, k)].seconds) * 1e3, 3)
                            if (b, k) in self.cells else None
                            for k in range(self.k_max + 1)],
                # L(k*) from the acceptance model, and the tokens per sequence-step the chosen cell really made
                "expected_speedup": chosen * plain if measured and chosen else None,
                "realized_speedup": cell.tokens / best_s * plain if measured else None,
                # the k a batch of one policy alone would get (where more than the base drafted)
                "chosen_k_by_policy": {p: self.best(b, {p: 1}) for p in adapters},
            })
        return {"k_max": self.k_max, "draft_version": self.draft_version, "steps_by_k": self.steps_by_k,
                "off_steps": self.off_steps,
                "acceptance": self.acceptance(), "buckets": rows,
                # per policy (the base: ""), its own estimate and the sequence-steps it is measured on
                "policies": {p: {"acceptance": self.acceptance(p), "sequence_steps": a.reached[1]}
                             for p, a in self.by_policy.items()}}
