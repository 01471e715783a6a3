#!/usr/bin/env bash
# Evidence for the GRPO trainer (not a test). Runs one after another (2 cores: never two vLLM engines at once).
#
#   bash bench/grpo_runs.sh accuracy [STEPS] [LR]
#                                             one long sync run on the default model without speculation (the
#                                             fastest way to move the policy here), held-out accuracy on the same
#                                             256 problems before, every 3 steps and at the end; default 16 steps
#                                             at lr 5e-6 (~6 min per step on 2 cores)
#   bash bench/grpo_runs.sh compare [STEPS]    short runs that differ in one thing each, on the same batch shape
#                                             (half the accuracy run's: 4 prompts x 8 samples, to fit a session):
#                                             speculation on/off, sync/async, drafter adaptation on/off;
#                                             default 3 steps each (~35 min); run `rollout-service
#                                             prepare-drafter` first, or the drafter is an undistilled cut
#   bash bench/grpo_runs.sh report             plots and the side-by-side table into bench/results/grpo/
#
# Each run writes runs/<name>/metrics.jsonl; a run stopped early (Ctrl-C) keeps the steps it finished.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
what=${1:-}
common=(--prompts 8 --group-size 8 --max-tokens 64 --lr 5e-6)
compared=(sync-nospec sync-spec-adapt async-spec-adapt sync-spec-frozen)
run() { name=$1; shift; echo "=== $name: $*"; rm -rf "runs/$name"; "$py" -m trainer_example.train "${common[@]}" --out "runs/$name" "$@"; }
case "$what" in
  accuracy)
    run accuracy-sync-nospec --mode sync --steps "${2:-16}" --lr "${3:-5e-6}" --eval-size 256 --eval-every 3 \
        --speculation none ;;
  compare)
    steps=${2:-3}
    short=(--steps "$steps" --prompts 4 --eval-size 16 --eval-every 1000 --draft-every 1)
    run sync-nospec      --mode sync  "${short[@]}" --speculation none
    run sync-spec-adapt  --mode sync  "${short[@]}" --speculation draft_model --adapt-drafter
    run async-spec-adapt --mode async "${short[@]}" --speculation draft_model --adapt-drafter
    run sync-spec-frozen --mode sync  "${short[@]}" --speculation draft_model --no-adapt-drafter ;;
  report)
    out=bench/results/grpo
    mkdir -p "$out"
    dirs=()
    # sync-nospec first: the table's ratios are against it (the accuracy run has twice the batch: not comparable)
    for d in "${compared[@]/#/runs/}" runs/accuracy-sync-nospec; do [[ -s $d/metrics.jsonl ]] && dirs+=("$d"); done
    "$py" -m trainer_example.plot "${dirs[@]/%//metrics.jsonl}" --out "$out"
    for d in "${dirs[@]}"; do cp "$d/metrics.jsonl" "$out/$(basename "$d").metrics.jsonl"; done
    "$py" -m bench.grpo_table "${dirs[@]}" --steps "${2:-3}" | tee "$out/table.md" ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
