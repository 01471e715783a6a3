#!/usr/bin/env bash
# Evidence for the GRPO trainer (not a test): one long sync run on the default model with speculation and
# online drafter adaptation (held-out accuracy over time), then short runs that differ in one thing each,
# for step-time ratios and acceptance with / without adaptation. Runs one after another (2 cores: never
# two vLLM engines at once). ~65 min on 2 cores with the defaults. Results: runs/<name>/metrics.jsonl;
# the plots and the side-by-side table go to bench/results/grpo/ (what the README shows).
#   bash bench/grpo_runs.sh [LONG_STEPS] [SHORT_STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
long=${1:-14}
short=${2:-3}
py=${PYTHON:-.venv/bin/python}
common=(--prompts 8 --group-size 8 --max-tokens 64 --lr 5e-6 --eval-size 96)
run() { name=$1; shift; echo "=== $name: $*"; rm -rf "runs/$name"; "$py" -m trainer_example.train "${common[@]}" --out "runs/$name" "$@"; }
run sync-spec-adapt   --mode sync  --steps "$long"  --eval-every 3 --speculation draft_model --adapt-drafter
run sync-nospec       --mode sync  --steps "$short" --eval-every 100 --speculation none
run async-spec-adapt  --mode async --steps "$short" --eval-every 100 --speculation draft_model --adapt-drafter
run sync-spec-frozen  --mode sync  --steps "$short" --eval-every 100 --speculation draft_model --no-adapt-drafter
out=bench/results/grpo
mkdir -p "$out"
dirs=(runs/sync-spec-adapt runs/sync-nospec runs/async-spec-adapt runs/sync-spec-frozen)
"$py" -m trainer_example.plot "${dirs[@]/%//metrics.jsonl}" --out "$out"
"$py" -m bench.grpo_table "${dirs[@]}" --steps "$short" | tee "$out/table.md"
