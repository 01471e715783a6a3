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
#   bash bench/grpo_runs.sh compare-eagle3 [STEPS]
#                                             the same batch shape against a service the script starts itself,
#                                             plain or with the cached EAGLE-3 head and the k controller (the
#                                             default, k = 0..3): sync and async; the head is not adapted online
#                                             (the trainer adapts draft models only). Needs `rollout-service
#                                             prepare-drafter --kind eagle3` first; ~35 min
#   bash bench/grpo_runs.sh adapt [STEPS]      online drafter adaptation against the same drafter frozen, over a
#                                             longer run (default 20 steps, ~21 min each, one optimizer step per
#                                             batch): a draft model cut from
#                                             the policy's first 2 layers (`prepare-drafter --epochs 0`, into
#                                             runs/drafter-cut), fixed k = 3 so every step measures acceptance,
#                                             the drafter pushed every 2 steps; then `report 20 adapt-frozen
#                                             adapt-online` with OUT=bench/results/grpo-adapt
#   bash bench/grpo_runs.sh adapt-eagle3 [STEPS] [LR]
#                                             the cached EAGLE-3 head adapted online (the trainer trains it on each
#                                             step's samples from the policy's own hidden states, pushes it every
#                                             DRAFT_EVERY=1 steps, on HEAD_SAMPLES=12 of the step's 32 samples to
#                                             keep it under 10% of a step) against the same head frozen: same seed,
#                                             same service settings (k chosen per step, k <= 3; K_CONTROL=fixed
#                                             drafts k = 3 every step), default 30 steps at lr 5e-6 (the
#                                             accuracy run's; the policy moves: KL
#                                             to the start is reported), 4 x 8 samples, MODE=sync (or async: the
#                                             head trains in the background); ARMS="frozen online" sets the order,
#                                             TAG a suffix for repeated passes; then per step acceptance (and per
#                                             position), mean k, generation and adaptation time, the goals checked
#                                             and plots: bench/eagle3_adapt.py into OUT=bench/results/grpo-eagle3-adapt
#                                             (~1 min per step on 2 cores; `adapt-eagle3 2` is the smoke test); the
#                                             online arm saves its final policy and head (runs/eagle3-online/policy,
#                                             eagle3-head) for `bench/speculation.py --model ... --eagle3-head ...`
#   bash bench/grpo_runs.sh int8 [STEPS] [LR]  int8 rollouts (serve --quantization int8, no speculation) trained in
#                                             float32, with and without the rollout correction: ARMS="none tis" (the
#                                             order; --rollout-correction each), same SEED (default 0), default 10
#                                             steps at lr 1e-5, 4 x 8 samples, held-out accuracy on the same 64
#                                             problems before and after (~13 min per run); runs/int8-<arm>$TAG; then
#                                             the table and plots into OUT=bench/results/grpo-int8
#   bash bench/grpo_runs.sh report [STEPS] [RUN...]
#                                             plots and the side-by-side table into bench/results/grpo/ (the
#                                             runs named, default the `compare` runs; the first is the baseline;
#                                             OUT=DIR writes elsewhere)
#
# Each run writes runs/<name>/metrics.jsonl; a run stopped early (Ctrl-C) keeps the steps it finished.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
what=${1:-}
common=(--prompts 8 --group-size 8 --max-tokens 64 --lr 5e-6)
compared=(sync-nospec sync-spec-adapt async-spec-adapt sync-spec-frozen)
run() { name=$1; shift; echo "=== $name: $*"; rm -rf "runs/$name"; "$py" -m trainer_example.train "${common[@]}" --out "runs/$name" "$@"; }
# against_service NAME "SERVE ARGS" TRAINER ARGS...: start `rollout-service serve` with SERVE ARGS, run the
# trainer against it, stop it (also when the trainer fails)
against_service() {
  name=$1 serve_args=$2; shift 2
  rm -rf "runs/$name"; mkdir -p "runs/$name"
  read -r grpc http < <("$py" -c 'from rollout_client.launcher import free_port; print(free_port(), free_port())')
  # shellcheck disable=SC2086
  "$py" -m rollout_service.cli serve --grpc-port "$grpc" --http-port "$http" --dtype float32 $serve_args \
      > "runs/$name/service.log" 2>&1 &
  svc=$!
  trap 'kill $svc 2>/dev/null; wait $svc 2>/dev/null' EXIT
  until curl -sf "http://127.0.0.1:$http/readyz" > /dev/null; do
    kill -0 $svc 2>/dev/null || { echo "the service failed to start: runs/$name/service.log"; exit 1; }
    sleep 2
  done
  echo "=== $name (service: $serve_args): $*"
  "$py" -m trainer_example.train "${common[@]}" --out "runs/$name" --target "127.0.0.1:$grpc" "$@"
  kill $svc; wait $svc 2>/dev/null || true; trap - EXIT
}
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
  compare-eagle3)
    steps=${2:-3}
    short=(--steps "$steps" --prompts 4 --eval-size 16 --eval-every 1000)
    head=$("$py" -c 'from rollout_service.drafting.drafters import default_drafter_dir; print(default_drafter_dir("eagle3"))')
    [[ -s $head/config.json ]] || { echo "no EAGLE-3 head at $head: run rollout-service prepare-drafter --kind eagle3"; exit 1; }
    against_service eagle3-sync-nospec "--speculation none" --mode sync "${short[@]}"
    against_service eagle3-sync-auto "--speculation eagle3 --draft-model $head" --mode sync "${short[@]}"
    against_service eagle3-async-auto "--speculation eagle3 --draft-model $head" --mode async "${short[@]}" ;;
  adapt)
    steps=${2:-20}
    long=(--steps "$steps" --prompts 4 --eval-size 16 --eval-every 1000 --draft-every 2 --minibatches 1)
    cut=runs/drafter-cut
    [[ -s $cut/config.json ]] || "$py" -m rollout_service.cli prepare-drafter --epochs 0 --out "$cut"
    serve="--speculation draft_model --draft-model $cut --k-control fixed --num-speculative-tokens 3"
    against_service adapt-frozen "$serve" --mode sync "${long[@]}" --drafter "$cut" --no-adapt-drafter
    against_service adapt-online "$serve" --mode sync "${long[@]}" --drafter "$cut" --adapt-drafter ;;
  adapt-eagle3)
    steps=${2:-30} lr=${3:-5e-6} tag=${TAG:-}
    head=$("$py" -c 'from rollout_service.drafting.drafters import default_drafter_dir; print(default_drafter_dir("eagle3"))')
    [[ -s $head/config.json ]] || { echo "no EAGLE-3 head at $head: run rollout-service prepare-drafter --kind eagle3"; exit 1; }
    long=(--steps "$steps" --lr "$lr" --prompts 4 --eval-size 16 --eval-every 1000 --mode "${MODE:-sync}"
          --seed "${SEED:-0}" --drafter "$head")
    serve="--speculation eagle3 --draft-model $head --num-speculative-tokens 3 --k-control ${K_CONTROL:-auto}"
    for arm in ${ARMS:-frozen online}; do
      case $arm in
        frozen) against_service "eagle3-frozen$tag" "$serve" "${long[@]}" --no-adapt-drafter ;;
        online) against_service "eagle3-online$tag" "$serve" "${long[@]}" --adapt-drafter \
                    --draft-every "${DRAFT_EVERY:-1}" --head-samples "${HEAD_SAMPLES:-12}" --save-final ;;
        *) echo "unknown arm $arm (frozen, online)"; exit 2 ;;
      esac
    done
    "$py" -m bench.eagle3_adapt "runs/eagle3-frozen$tag" "runs/eagle3-online$tag" \
        --out "${OUT:-bench/results/grpo-eagle3-adapt}" --last "$(( steps > 10 ? 10 : steps ))" ;;
  int8)
    steps=${2:-10} lr=${3:-1e-5} tag=${TAG:-}
    q=(--steps "$steps" --lr "$lr" --prompts 4 --eval-size 64 --eval-every 1000 --mode sync --seed "${SEED:-0}"
       --quantization int8 --speculation none)
    names=()
    for arm in ${ARMS:-none tis}; do
      run "int8-$arm$tag" "${q[@]}" --rollout-correction "$arm"; names+=("int8-$arm$tag")
    done
    OUT=${OUT:-bench/results/grpo-int8} bash bench/grpo_runs.sh report "$steps" "${names[@]}" ;;
  report)
    out=${OUT:-bench/results/grpo}
    mkdir -p "$out"
    dirs=()
    # sync-nospec first: the table's ratios are against it (the accuracy run has twice the batch: not comparable)
    names=("${@:3}")
    [[ ${#names[@]} -gt 0 ]] || names=("${compared[@]}" accuracy-sync-nospec)
    for d in "${names[@]/#/runs/}"; do [[ -s $d/metrics.jsonl ]] && dirs+=("$d"); done
    "$py" -m trainer_example.plot "${dirs[@]/%//metrics.jsonl}" --out "$out"
    for d in "${dirs[@]}"; do cp "$d/metrics.jsonl" "$out/$(basename "$d").metrics.jsonl"; done
    "$py" -m bench.grpo_table "${dirs[@]}" --steps "${2:-3}" | tee "$out/table.md" ;;
  *) sed -n 2,52p "$0"; exit 2 ;;
esac
