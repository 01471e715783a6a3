#!/usr/bin/env bash
# Build and run the images as users do, and check them from the host. On demand, not in CI (it takes minutes:
# a cold build ~10, the container's first start ~3, the compose stack and 2 GRPO steps ~10 more).
#
#   bash docker/run_check.sh                 # the CPU image: build, run, check from the host
#   bash docker/run_check.sh --stack         # ... then the compose stack (Ray head, Ray worker, the service),
#                                            #     2 GRPO steps from the host, a worker killed and recovered
#   bash docker/run_check.sh --stack-only    # the compose stack on the image already built
#   options: --no-cache (a cold build: no layer reused), --skip-build (use the image as it is), --keep (leave the
#            containers running), --port-base N (host ports N, N+1 for gRPC, HTTP; default: free ones)
#   (bash docker/check.sh --run [options] runs the static checks first, then this)
#
# The engine: Docker where one answers (`docker info`); else podman with runc from Debian's packages (installed
# with apt when missing; run as root). podman is configured in /etc/containers/containers.conf.d/50-rollout-
# run-check.conf: runtime runc (crun fails in some sandboxes on setrlimit and hybrid cgroups), no default
# ulimits, the netavark network backend (container names resolve in the compose network).
# When the registry cannot be reached, the base image of Dockerfile.cpu (python:3.11-slim-bookworm) is stood in
# for by Debian bookworm from Debian's mirror (debootstrap --variant=minbase, python3 and python3-venv), tagged
# with the FROM name and labelled as a stand-in: the Dockerfile stays the one users build.
# podman builds get this machine's pip settings (`pip config list`: files and environment, one file mounted
# read-only as /etc/pip.conf, and the local paths it names -- wheel folders, file:// indexes, constraints, the CA
# bundle -- mounted read-only at the same paths) and --network host.
#
# Prints PASS/FAIL per check and a summary with the timings; exits 1 when any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

image=${ROLLOUT_IMAGE:-rollout-service:cpu}
base_image=docker.io/library/python:3.11-slim-bookworm      # Dockerfile.cpu's FROM, fully qualified
do_image=1 do_stack=0 no_cache=0 skip_build=0 keep=0 port_base=""
while [ $# -gt 0 ]; do
  case "$1" in
    --stack) do_stack=1 ;;
    --stack-only) do_stack=1; do_image=0; skip_build=1 ;;
    --no-cache) no_cache=1 ;;
    --skip-build) skip_build=1 ;;
    --keep) keep=1 ;;
    --port-base) port_base=$2; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "run_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

py=$ROOT/.venv/bin/python
[ -x "$py" ] || { echo "run_check.sh: $py missing: run scripts/install.sh first (the host client runs from it)" >&2; exit 2; }
work=$(mktemp -d /tmp/rollout-run-check.XXXXXX)
summary=()
failures=0
log() { printf '[%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
pass() { summary+=("PASS  $1${2:+: $2}"); log "PASS $1${2:+: $2}"; }
fail() { summary+=("FAIL  $1${2:+: $2}"); log "FAIL $1${2:+: $2}"; failures=$((failures + 1)); }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

finish() {
  echo
  echo "================ docker/run_check.sh summary ($(date -u +%Y-%m-%dT%H:%MZ), engine: ${engine:-none}) ================"
  printf '%s\n' "${summary[@]}"
  echo "work directory (logs, tokens): $work"
  if [ "$failures" -gt 0 ]; then echo "FAILED: $failures check(s)"; exit 1; fi
  echo "all checks passed"
  exit 0
}

# ------------------------------------------------------------------ the engine
engine=""
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  engine=docker
else
  engine=podman
  # podman and runc; catatonit for `--init` / compose's `init: true`; netavark and aardvark-dns for name resolution
  # in a compose network; iptables, which netavark runs to set a network up (without it `run` stopped with
  # "netavark: No such file or directory" on a fresh machine)
  missing=()
  for pkg in podman runc catatonit netavark aardvark-dns iptables; do
    dpkg -s "$pkg" > /dev/null 2>&1 || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null 2>&1; then
      command -v podman > /dev/null 2>&1 || { echo "run_check.sh: no Docker engine and no podman (run as root on Debian to install it)" >&2; exit 2; }
      log "not installing ${missing[*]} (not root, or no apt-get): podman as it is"
    else
      log "installing ${missing[*]} from Debian's packages (apt)"
      { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
        > "$work/apt.log" 2>&1 || { fail "install podman" "see $work/apt.log"; finish; }
    fi
  fi
  conf=/etc/containers/containers.conf.d/50-rollout-run-check.conf
  if [ ! -f "$conf" ] && [ "$(id -u)" = 0 ]; then
    mkdir -p "$(dirname "$conf")"
    backend=""
    # netavark resolves container names in a compose network (the CNI backend needs the dnsname plugin); only
    # switched to while podman has no containers of its own yet (a backend is chosen once per storage)
    if [ -x /usr/lib/podman/netavark ] || command -v netavark >/dev/null 2>&1; then
      [ -z "$(podman ps -aq 2>/dev/null)" ] && backend='network_backend = "netavark"'
    fi
    cat > "$conf" <<EOF
# Written by rollout-service's docker/run_check.sh: runc (crun cannot set rlimits in some sandboxes), no default
# ulimits (a container may not raise them above the host's hard limits), and netavark for name resolution.
[containers]
default_ulimits = []
[engine]
runtime = "runc"
[network]
$backend
EOF
    log "configured podman: $conf"
  fi
fi
log "engine: $engine ($($engine --version 2>/dev/null | head -1))"
E() { "$engine" "$@"; }

# ------------------------------------------------------------------ tokens, as compose mounts its secrets
mkdir -p "$work/secrets"
(umask 077; head -c 32 /dev/urandom | base64 > "$work/secrets/client.token"
           head -c 32 /dev/urandom | base64 > "$work/secrets/admin.token")
chown 1000 "$work/secrets/"*.token 2>/dev/null || chmod 0444 "$work/secrets/"*.token   # the image's user reads them
chmod 0755 "$work" "$work/secrets"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ports() {   # gRPC and HTTP ports on the host
  if [ -n "$port_base" ]; then grpc_port=$port_base http_port=$((port_base + 1)); else grpc_port=$(free_port) http_port=$(free_port); fi
}
host_checks() {
  "$py" docker/host_checks.py --grpc "127.0.0.1:$grpc_port" --http "http://127.0.0.1:$http_port" \
    --token-file "$work/secrets/client.token" --admin-token-file "$work/secrets/admin.token" "$@"
}
# run host checks; PASS/FAIL per JSON line, the line itself as the detail
run_host_checks() {
  local prefix=$1; shift
  local out line name ok
  out=$(host_checks "$@" 2>>"$work/host_checks.err")
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    name=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["check"])' "$line")
    ok=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["ok"])' "$line")
    if [ "$ok" = True ]; then pass "$prefix$name" "$line"; else fail "$prefix$name" "$line"; fi
  done <<< "$out"
  [ -n "$out" ] || fail "${prefix}host checks" "no output: see $work/host_checks.err"
  last_checks=$out
}
json_field() { python3 -c 'import json, sys
for l in sys.stdin:
    d = json.loads(l)
    if d["check"] == sys.argv[1]: print(d.get(sys.argv[2], ""))' "$1" "$2" <<< "$last_checks"; }

# ------------------------------------------------------------------ the base image
ensure_base() {
  if E image exists "$base_image" 2>/dev/null || E image inspect "$base_image" >/dev/null 2>&1; then
    local what
    what=$(E image inspect --format '{{index .Config.Labels "rollout.stand-in"}}' "$base_image" 2>/dev/null)
    pass "base image" "$base_image present${what:+ (stand-in: $what)}"
    return
  fi
  local t0; t0=$(now)
  if timeout 120 "$engine" pull "$base_image" > "$work/pull.log" 2>&1; then
    pass "base image" "pulled $base_image in $(since "$t0") s"
    return
  fi
  log "cannot pull $base_image ($(tail -1 "$work/pull.log")): building a stand-in from Debian's packages"
  if [ "$engine" != podman ] || [ "$(id -u)" != 0 ]; then fail "base image" "no registry and no stand-in (needs root + podman)"; return; fi
  command -v debootstrap >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap \
    > "$work/apt-debootstrap.log" 2>&1
  local rootfs=$work/rootfs mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
  t0=$(now)
  if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
      > "$work/debootstrap.log" 2>&1; then
    fail "base image" "debootstrap failed: see $work/debootstrap.log"; return
  fi
  # as the official image: bookworm, its updates and security; no apt lists or caches in the layer
  cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
  ln -sf python3 "$rootfs/usr/bin/python"
  local pyv; pyv=$(chroot "$rootfs" python3 -c 'import platform; print(platform.python_version())')
  tar -C "$rootfs" -c . | E import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'ENV LANG=C.UTF-8' \
      --change 'CMD ["python3"]' \
      --change "LABEL rollout.stand-in=\"debootstrap --variant=minbase bookworm, Debian's python3 $pyv, by docker/run_check.sh\"" \
      - "$base_image" > "$work/import.log" 2>&1 \
    || { fail "base image" "import failed: see $work/import.log"; rm -rf "$rootfs"; return; }
  rm -rf "$rootfs"
  pass "base image" "stand-in for $base_image from debootstrap (Python $pyv) in $(since "$t0") s"
}

# ------------------------------------------------------------------ this machine's pip settings, for podman builds
pip_build_args() {
  pip_args=()
  [ "$engine" = podman ] || return 0
  "$py" -m pip config list > "$work/pip-config.txt" 2>/dev/null || return 0
  python3 - "$work/pip-config.txt" "$work/pip.conf" "$work/pip-mounts.txt" "$work/pip-extra-index.txt" <<'PY'
import os, re, sys
src, conf, mounts_file, extra = sys.argv[1:]
merged, order = {}, {"global": 0, "install": 1, ":env:": 2}      # pip's precedence: env over install over global
for line in open(src):
    m = re.match(r"^(.+?)\.([\w-]+)='(.*)'$", line.strip())
    if not m or m.group(1) not in order:
        continue
    section, key, value = m.groups()
    if key not in merged or order[section] >= merged[key][0]:
        merged[key] = (order[section], value)
mounts = {}                                   # host path -> path in the build
if "cert" in merged and os.path.isfile(merged["cert"][1]):
    # the CA bundle beside the image's own (a package install may rewrite /etc/ssl/certs)
    mounts[os.path.realpath(merged["cert"][1])] = "/run/host-pip-ca.crt"
    merged["cert"] = (merged["cert"][0], "/run/host-pip-ca.crt")
for key, (_, value) in merged.items():
    if key == "cert":
        continue
    for tok in value.split():
        p = tok[len("file://"):] if tok.startswith("file://") else tok
        if not p.startswith("/") or not os.path.exists(p):
            continue
        p = p.rstrip("/")
        if tok.startswith("file://") and os.path.basename(p) == "simple":
            p = os.path.dirname(p)                # a file:// index links its files relative to itself (../../files)
        mounts[os.path.realpath(p) if os.path.isfile(p) else p] = p
with open(conf, "w") as f:
    f.write("# this machine's pip settings (pip config list), for the build: docker/run_check.sh\n[global]\n")
    for key, (_, value) in sorted(merged.items()):
        f.write(f"{key} = {value}\n")
open(mounts_file, "w").write("".join(f"{h}:{c}\n" for h, c in sorted(mounts.items())))
open(extra, "w").write(merged.get("extra-index-url", (0, ""))[1])
PY
  pip_args=(--network host -v "$work/pip.conf:/etc/pip.conf:ro")
  local p
  while IFS= read -r p; do [ -n "$p" ] && pip_args+=(-v "$p:ro"); done < "$work/pip-mounts.txt"
  # Dockerfile.cpu's PIP_EXTRA_INDEX_URL (PyTorch's CPU index) would override the machine's extra index
  [ -s "$work/pip-extra-index.txt" ] && pip_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$(cat "$work/pip-extra-index.txt")")
}

build_image() {
  pip_build_args
  local args=(-f docker/Dockerfile.cpu -t "$image")
  [ "$engine" = podman ] && args+=(--format docker)        # OCI images drop HEALTHCHECK
  [ "$no_cache" = 1 ] && args+=(--no-cache)
  log "building $image: $engine build ${args[*]} ${pip_args[*]} .  (log: $work/build.log)"
  local t0; t0=$(now)
  if E build "${args[@]}" "${pip_args[@]}" . > "$work/build.log" 2>&1; then
    build_s=$(since "$t0")
    local cached; cached=$(grep -c -i "using cache" "$work/build.log")
    size=$(E image inspect --format '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}')
    pass "build" "$image in $build_s s ($([ "$no_cache" = 1 ] && echo cold || echo "$cached steps from cache")), $size"
  else
    build_s=$(since "$t0")
    fail "build" "after $build_s s: $(grep -E -i 'error|failed' "$work/build.log" | tail -3 | tr '\n' ' ')(see $work/build.log)"
    finish
  fi
}

inspect_image() {
  local user hc ep
  user=$(E image inspect --format '{{.Config.User}}' "$image")
  hc=$(E image inspect --format '{{json .Config.Healthcheck}}' "$image")
  ep=$(E image inspect --format '{{json .Config.Entrypoint}}' "$image")
  if [ "$user" = rollout ] && [[ "$hc" == *healthcheck.py* ]] && [[ "$ep" == *rollout-service* ]]; then
    pass "image config" "user $user, entrypoint $ep, healthcheck kept"
  else
    fail "image config" "user '$user', entrypoint $ep, healthcheck $hc"
  fi
  # the build's pip settings and the paths it mounted must not end up in the image (podman 4.3's buildah leaves
  # its mount points behind: empty files and folders)
  local points=(/etc/pip.conf) found
  [ -f "$work/pip-mounts.txt" ] && mapfile -t -O 1 points < <(cut -d: -f2 "$work/pip-mounts.txt")
  points[0]=/etc/pip.conf
  found=$(E run --rm --entrypoint sh "$image" -c 'for p in "$@"; do [ -e "$p" ] && find "$p" -type f -size +0; done; true' \
          sh "${points[@]}" 2>/dev/null)
  if [ -z "$found" ]; then
    pass "no build settings in the image" "nothing in ${points[*]} (at most empty mount points)"
  else
    fail "no build settings in the image" "files with content: $(echo "$found" | head -5 | tr '\n' ' ')"
  fi
}

# ------------------------------------------------------------------ one container, as `docker run`
run_image() {
  ports
  local name=rollout-run-check vol=rollout-run-check-models
  E rm -f "$name" > /dev/null 2>&1
  E volume rm -f "$vol" > /dev/null 2>&1
  local run=(run -d --name "$name" --init --cap-add SYS_NICE --security-opt seccomp=unconfined --shm-size 4g
             -p "127.0.0.1:$grpc_port:50051" -p "127.0.0.1:$http_port:8000" -v "$vol:/models"
             -v "$work/secrets/client.token:/run/secrets/client_token:ro"
             -v "$work/secrets/admin.token:/run/secrets/admin_token:ro" "$image")
  log "$engine ${run[*]}"
  local t0; t0=$(now)
  E "${run[@]}" > "$work/run.id" 2> "$work/run.err" || { fail "run" "$(cat "$work/run.err")"; return; }
  # ready: /readyz without a token (an orchestrator's probe), from the host
  run_host_checks "" --alive "$engine inspect --format {{.State.Running}} $name" ready
  ready_s=$(since "$t0")
  if [ "$(E inspect --format '{{.State.Running}}' "$name")" != true ]; then
    fail "container" "exited: $(E logs --tail 20 "$name" 2>&1 | tr '\n' ' ')"
    E logs "$name" > "$work/container.log" 2>&1
    return
  fi
  pass "run to ready" "$ready_s s from \`$engine run\` to /readyz 200 (fresh model volume: the model is converted first)"
  run_host_checks "" http-auth generate push status
  # the image's HEALTHCHECK command (from the image's config), run in the container now rather than at its interval
  # (podman schedules health checks with systemd timers, which a machine without systemd lacks)
  local test hc
  test=$(E image inspect --format '{{json .Config.Healthcheck.Test}}' "$image")
  mapfile -t hc_cmd < <(python3 -c 'import json, sys
t = json.loads(sys.argv[1]) or ["NONE"]
print("\n".join(t[1:] if t[0] == "CMD" else ["sh", "-c", t[1]] if t[0] == "CMD-SHELL" else ["false"]))' "$test")
  hc=$(E exec "$name" "${hc_cmd[@]}" 2>&1; echo "rc=$?")
  if [[ "$hc" == *rc=0 ]]; then pass "healthcheck" "${hc_cmd[*]}: ${hc//$'\n'/ }"; else fail "healthcheck" "$test: ${hc//$'\n'/ }"; fi
  # SIGTERM: the engine stops, the process exits 0, well within compose's stop_grace_period (60 s)
  t0=$(now)
  E stop -t 60 "$name" > /dev/null 2>&1
  local stop_s code
  stop_s=$(since "$t0")
  code=$(E inspect --format '{{.State.ExitCode}}' "$name")
  E logs "$name" > "$work/container.log" 2>&1
  if [ "$code" = 0 ] && python3 -c "import sys; sys.exit(float(sys.argv[1]) > 30)" "$stop_s"; then
    pass "SIGTERM" "exit $code after $stop_s s"
  else
    fail "SIGTERM" "exit $code after $stop_s s (see $work/container.log)"
  fi
  if grep -q -F -f <(cat "$work/secrets/client.token" "$work/secrets/admin.token") "$work/container.log"; then
    fail "tokens not logged" "a token appears in $work/container.log"
  else
    pass "tokens not logged" "neither token in the container's log ($(wc -l < "$work/container.log") lines)"
  fi
  if [ "$keep" = 0 ]; then E rm -f "$name" > /dev/null 2>&1; E volume rm -f "$vol" > /dev/null 2>&1; fi
}

# ------------------------------------------------------------------ the compose stack
compose_cmd=()
ensure_compose() {
  if [ "$engine" = docker ] && docker compose version >/dev/null 2>&1; then
    compose_cmd=(docker compose)
  else
    local venv=${XDG_CACHE_HOME:-$HOME/.cache}/rollout-service/podman-compose
    if [ ! -x "$venv/bin/podman-compose" ]; then
      log "installing podman-compose from PyPI into $venv"
      python3 -m venv "$venv" && "$venv/bin/python" -m pip install -q podman-compose > "$work/pip-compose.log" 2>&1 \
        || { fail "podman-compose" "install failed: see $work/pip-compose.log"; return 1; }
    fi
    compose_cmd=("$venv/bin/podman-compose")
  fi
  log "compose: ${compose_cmd[*]} ($("${compose_cmd[@]}" version 2>/dev/null | tail -1))"
}

container_of() {   # the container of a compose service
  E ps -a --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1
}

run_stack() {
  ensure_compose || return
  ports
  export ROLLOUT_IMAGE=$image ROLLOUT_GRPC_PORT=$grpc_port ROLLOUT_HTTP_PORT=$http_port
  export ROLLOUT_CLIENT_TOKEN_FILE=$work/secrets/client.token ROLLOUT_ADMIN_TOKEN_FILE=$work/secrets/admin.token
  # the bundled trainer computes and pushes float32 weights: a float32 service (`auto` is bf16 where the CPU has it)
  export ROLLOUT_SERVE_ARGS=${ROLLOUT_SERVE_ARGS---dtype float32}
  local files=(-f docker/compose.yaml -f docker/compose.cpu.yaml)
  # What this host needs beyond compose.yaml, in one override file:
  # - compose.yaml raises the open-files limit to 65536. A host whose hard limit is lower (a sandbox without
  #   CAP_SYS_RESOURCE) cannot grant that, and podman, given any ulimit, also sets the process limit to 1048576:
  #   there the override resets `ulimits` and the containers keep the host's limits.
  # - Ray's memory monitor watches the host's memory when a container has no memory limit, and kills the engine
  #   actor when the host is above 95%, whoever uses it: on a machine shared with other work
  #   (RUN_CHECK_RAY_MEMORY_MONITOR=0, the default) it is off on the worker; the kernel's OOM killer still acts.
  local hard; hard=$(ulimit -Hn) over=$work/compose.check.yaml
  printf '%s\n' "# docker/run_check.sh: what this host needs" "services:" > "$over"
  for svc in ray-head ray-worker rollout; do
    printf '  %s:\n' "$svc" >> "$over"
    if [ "$hard" != unlimited ] && [ "$hard" -lt 65536 ]; then
      printf '    ulimits: !reset {}      # the hard open-files limit here is %s\n' "$hard" >> "$over"
    fi
    if [ "$svc" = ray-worker ] && [ "${RUN_CHECK_RAY_MEMORY_MONITOR:-0}" = 0 ]; then
      printf '    environment: {RAY_memory_monitor_refresh_ms: "0"}\n' >> "$over"
    fi
    [ "$(tail -1 "$over")" = "  $svc:" ] && printf '    labels: {rollout.run-check: "1"}\n' >> "$over"
  done
  files+=(-f "$over")
  log "this host's override: $over (hard open-files limit $hard)"
  C() { "${compose_cmd[@]}" "${files[@]}" "$@"; }
  C down -v > /dev/null 2>&1
  local t0; t0=$(now)
  log "${compose_cmd[*]} ${files[*]} up -d"
  if ! C up -d > "$work/compose-up.log" 2>&1; then
    fail "compose up" "see $work/compose-up.log"; C logs > "$work/compose.log" 2>&1; C down -v > /dev/null 2>&1; return
  fi
  run_host_checks "stack: " ready
  local stack_ready_s; stack_ready_s=$(since "$t0")
  C ps > "$work/compose-ps.txt" 2>&1
  pass "stack: up to ready" "$stack_ready_s s from \`up -d\` to /readyz 200"
  run_host_checks "stack: " status generate
  # the engine runs on the worker: its location names the worker container's host name
  local worker rollout wh rh loc
  worker=$(container_of ray-worker) rollout=$(container_of rollout)
  wh=$(E inspect --format '{{.Config.Hostname}}' "$worker")
  rh=$(E inspect --format '{{.Config.Hostname}}' "$rollout")
  loc=$(json_field status engines)
  if [ -n "$wh" ] && [[ "$loc" == *"'$wh "* ]]; then
    pass "stack: engine on the worker" "engines $loc; ray-worker's host name $wh, rollout's $rh"
  else
    fail "stack: engine on the worker" "engines $loc; ray-worker's host name $wh, rollout's $rh"
  fi
  E exec "$(container_of ray-head)" ray status > "$work/ray-status.txt" 2>&1
  # the bundled GRPO trainer from the host, 2 steps, PushWeights (the weight-transfer group needs the trainer
  # reachable from the worker's network; a published gRPC port is all the host offers here)
  t0=$(now)
  log "rollout-grpo --target 127.0.0.1:$grpc_port --steps 2 --weight-sync push (log: $work/grpo.log)"
  if ROLLOUT_AUTH_TOKEN=$(cat "$work/secrets/client.token") ROLLOUT_ADMIN_TOKEN=$(cat "$work/secrets/admin.token") \
      "$ROOT/.venv/bin/rollout-grpo" --target "127.0.0.1:$grpc_port" --steps 2 --weight-sync push \
      --out "$work/grpo" > "$work/grpo.log" 2>&1; then
    pass "stack: 2 GRPO steps" "$(since "$t0") s; $(grep -c '"step"' "$work/grpo/metrics.jsonl" 2>/dev/null) metric lines"
  else
    fail "stack: 2 GRPO steps" "after $(since "$t0") s: $(tail -3 "$work/grpo.log" | tr '\n' ' ')"
  fi
  # a node dies: kill the worker container's processes (not `stop`: a crash, which restart: unless-stopped
  # brings back); the engine is replaced at the committed version once the worker has rejoined
  run_host_checks "stack: " status
  local version_before; version_before=$(json_field status policy_version)
  local pid; pid=$(E inspect --format '{{.State.Pid}}' "$worker")
  log "killing ray-worker ($worker, pid $pid) with SIGKILL"
  t0=$(now)
  kill -9 "$pid"
  run_host_checks "stack: worker killed: " wait-unready
  run_host_checks "stack: worker killed: " ready
  local recover_s; recover_s=$(since "$t0")
  run_host_checks "stack: after recovery: " status generate
  local restarts; restarts=$(E inspect --format '{{.RestartCount}}' "$worker" 2>/dev/null)
  local after; after=$(json_field status policy_version)
  if [ "$after" = "$version_before" ]; then
    pass "stack: recovered" "$recover_s s from the kill to ready; worker restarted ($restarts); policy version $after kept"
  else
    fail "stack: recovered" "$recover_s s; policy version $version_before before, $after after"
  fi
  # the front end dies: restart: on-failure brings it back; it rejoins Ray and starts its engine on the worker again
  pid=$(E inspect --format '{{.State.Pid}}' "$rollout")
  log "killing rollout ($rollout, pid $pid) with SIGKILL"
  t0=$(now)
  kill -9 "$pid"
  run_host_checks "stack: front end killed: " wait-unready
  run_host_checks "stack: front end killed: " ready
  recover_s=$(since "$t0")
  run_host_checks "stack: front end restarted: " status generate
  restarts=$(E inspect --format '{{.RestartCount}}' "$rollout" 2>/dev/null)
  after=$(json_field status policy_version)
  if [ "$after" = "$version_before" ]; then
    pass "stack: front end recovered" "$recover_s s from the kill to ready; restarted ($restarts); serves policy version $after, the committed one (--state-dir)"
  else
    fail "stack: front end recovered" "serves policy version $after after the restart, not the committed $version_before"
  fi
  C logs > "$work/compose.log" 2>&1
  # stop: SIGTERM, the front end first (as Docker Compose orders it: it depends on the Ray nodes; podman-compose
  # 1.6 signals every container at once, and a front end whose Ray cluster is going away cannot stop its engines)
  t0=$(now)
  C stop rollout > "$work/compose-stop.log" 2>&1
  local code; code=$(E inspect --format '{{.State.ExitCode}}' "$rollout")
  if [ "$code" = 0 ]; then pass "stack: stop" "$(since "$t0") s, the service exited 0"; else fail "stack: stop" "the service exited $code after $(since "$t0") s"; fi
  C stop >> "$work/compose-stop.log" 2>&1
  C logs > "$work/compose.log" 2>&1
  if [ "$keep" = 0 ]; then C down -v > /dev/null 2>&1; fi
}

# ------------------------------------------------------------------ main
if [ "$do_image" = 1 ] || [ "$skip_build" = 0 ]; then
  if [ "$skip_build" = 0 ]; then ensure_base; build_image; fi
fi
if E image inspect "$image" > /dev/null 2>&1; then
  [ "$do_image" = 1 ] && inspect_image
else
  fail "image" "$image is not built"; finish
fi
[ "$do_image" = 1 ] && run_image
[ "$do_stack" = 1 ] && run_stack
finish
