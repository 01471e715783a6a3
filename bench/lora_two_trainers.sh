#!/usr/bin/env bash
# Run: bash bench/lora_two_trainers.sh (about 10 min on 2 cores). Two rollout-grpo --lora 8 trainers on one service (trainer_example/README.md's commands, 4 steps, eval 16).
cd "$(dirname "$0")/.."
out=bench/results/lora_two_trainers
rm -rf $out; mkdir -p $out
echo "start $(date -u) load $(cat /proc/loadavg)" > $out/run.txt
.venv/bin/rollout-service serve --max-adapters 4 --max-lora-rank 8 --speculation none --grpc-port 50071 --http-port 50072 > $out/service.log 2>&1 &
svc=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:50072/readyz >/dev/null && break; sleep 2; done
echo "ready $(date -u)" >> $out/run.txt
common="--target 127.0.0.1:50071 --lora 8 --steps 4 --prompts 4 --group-size 4 --max-tokens 48 --lr 5e-4 --eval-every 4 --eval-size 16"
timeout 2100 .venv/bin/rollout-grpo $common --policy-name arith --reward arithmetic --mode sync --out $out/arith > $out/arith.log 2>&1 &
a=$!
timeout 2100 .venv/bin/rollout-grpo $common --policy-name brief --reward brevity --mode async --out $out/brief > $out/brief.log 2>&1 &
b=$!
wait $a; echo "arith exit $?" >> $out/run.txt
wait $b; echo "brief exit $?" >> $out/run.txt
curl -s http://127.0.0.1:50072/v1/status > $out/status.json
kill -TERM $svc; wait $svc
echo "end $(date -u) load $(cat /proc/loadavg)" >> $out/run.txt
