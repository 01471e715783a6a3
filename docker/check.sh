#!/usr/bin/env bash
# Check docker/ statically, without building anything (fast; the unit tests run it).
#
#   bash docker/check.sh
#   bash docker/check.sh --run [run_check.sh options]    # then build and run the images: docker/run_check.sh
#
# Static checks (always): compose.yaml and compose.cpu.yaml parse and hold the expected services, ports,
# secrets, health checks and GPU reservation; every Dockerfile has a pinned FROM (no `latest`, no missing
# tag; the GPU image's vLLM tag equals the `gpu` extra's vllm pin), EXPOSE 50051 and 8000, a HEALTHCHECK
# by docker/healthcheck.py (on /healthz), a non-root USER, the rollout-service ENTRYPOINT, the steps of
# docker/image.sh, the same text in both Dockerfiles from "Shared by both images" on (user, ports, health
# check, entrypoint, secrets), and COPY sources that exist and are not
# excluded by .dockerignore; every `rollout-service serve` flag used in docker/ and docs/deployment.md
# exists in rollout_service/config.py or cli.py, and every `ray start` flag in the compose files exists in the
# installed Ray. Tool checks (when installed): `docker compose config -q` (or docker-compose v1 on the base
# file) and hadolint. Exit 1 on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
run=0
if [ "${1:-}" = --run ]; then run=1; shift; fi

fail=0
py=.venv/bin/python
[ -x "$py" ] || py=python3
if ! "$py" -c 'import yaml' 2>/dev/null; then
  echo "FAIL: PyYAML is not importable by $py (run scripts/install.sh, or pip install pyyaml)"
  exit 1
fi

echo "== static checks ($py)"
"$py" - <<'PY' || fail=1
import glob, re, sys, tomllib
from pathlib import Path

import yaml

errors: list[str] = []
checked = 0


def check(ok, what):
    global checked
    checked += 1
    if not ok:
        errors.append(what)


# Compose's merge-override tags (compose.cpu.yaml uses !reset).
class Loader(yaml.SafeLoader):
    pass


for tag in ("!reset", "!override"):
    Loader.add_constructor(tag, lambda loader, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)))

# serve's flags are declared with the config fields (rollout_service/config.py); cli.py adds --config
CLI = Path("rollout_service/cli.py").read_text() + Path("rollout_service/config.py").read_text()
ray_scripts = sorted(glob.glob(".venv/lib/python3*/site-packages/ray/scripts/scripts.py"))
RAY_CLI = Path(ray_scripts[0]).read_text() if ray_scripts else None


def serve_flags_ok(text, where):
    """Every --flag of a `rollout-service serve` command line exists in the CLI."""
    for flag in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))):
        check(flag == "--help" or f'"{flag}"' in CLI, f"{where}: `rollout-service serve {flag}` is not a flag in rollout_service/config.py or cli.py")


def ray_flags_ok(args, where):
    if RAY_CLI is None:
        return
    for a in args:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            check(f'"{flag}"' in RAY_CLI, f"{where}: `ray start {flag}` is not a flag of the installed Ray")


def as_list(cmd):
    return cmd if isinstance(cmd, list) else str(cmd).split()


# ---------------------------------------------------------------- compose.yaml
base = yaml.load(Path("docker/compose.yaml").read_text(), Loader=Loader)
svcs = base.get("services", {})
for name in ("ray-head", "ray-worker", "rollout"):
    check(name in svcs, f"compose.yaml: service {name} missing")
    if name in svcs:
        s = svcs[name]
        check(bool(s.get("image")), f"compose.yaml: {name} has no image")
        b = s.get("build") or {}
        df = Path("docker") / b.get("context", ".") / b.get("dockerfile", "Dockerfile")
        check(df.resolve().is_file(), f"compose.yaml: {name} builds from {df}, which does not exist")
        check(b.get("dockerfile") == "docker/Dockerfile.gpu", f"compose.yaml: {name} should build Dockerfile.gpu by default")
        hc = s.get("healthcheck") or {}
        check(hc.get("test") and not hc.get("disable"), f"compose.yaml: {name} has no healthcheck")
        check(s.get("init") is True, f"compose.yaml: {name} should run with init: true (reaps vLLM/Ray children)")

head, worker, roll = svcs.get("ray-head", {}), svcs.get("ray-worker", {}), svcs.get("rollout", {})
head_cmd = as_list(head.get("command", []))
check("start" in head_cmd and "--head" in head_cmd and "--block" in head_cmd,
      "compose.yaml: ray-head must run `ray start --head --block`")
check("--port=6379" in head_cmd, "compose.yaml: ray-head must use GCS port 6379")
check({"6379", "8265"} <= {str(p) for p in head.get("expose", [])}, "compose.yaml: ray-head must expose 6379 and 8265")
check(not head.get("ports"), "compose.yaml: ray-head must not publish ports (Ray has no authentication)")
check("8265/api/gcs_healthz" in " ".join(as_list(head.get("healthcheck", {}).get("test", []))),
      "compose.yaml: ray-head healthcheck should probe the dashboard's /api/gcs_healthz")
ray_flags_ok(head_cmd, "compose.yaml ray-head")

worker_cmd = as_list(worker.get("command", []))
check("--address=ray-head:6379" in worker_cmd and "--block" in worker_cmd,
      "compose.yaml: ray-worker must run `ray start --address=ray-head:6379 --block`")
ray_flags_ok(worker_cmd, "compose.yaml ray-worker")
check("52365/api/local_raylet_healthz" in " ".join(as_list(worker.get("healthcheck", {}).get("test", []))),
      "compose.yaml: ray-worker healthcheck should probe the dashboard agent's /api/local_raylet_healthz")
dep = worker.get("deploy", {})
check("replicas" in dep, "compose.yaml: ray-worker must be scalable with deploy.replicas")
devices = dep.get("resources", {}).get("reservations", {}).get("devices", [])
check(any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices),
      "compose.yaml: ray-worker must reserve GPUs (driver: nvidia, capabilities: [gpu])")
check(worker.get("depends_on", {}).get("ray-head", {}).get("condition") == "service_healthy",
      "compose.yaml: ray-worker must wait for a healthy ray-head")

rcmd = " ".join(as_list(roll.get("command", [])))
for part in ("rollout-service serve", "--host 0.0.0.0", "--ray-address ray-head:6379",
             "--token-file /run/secrets/client_token", "--admin-token-file /run/secrets/admin_token",
             "ray start --address=ray-head:6379"):
    check(part in rcmd, f"compose.yaml: rollout command lacks `{part}`")
serve_part = rcmd.split("rollout-service serve", 1)[-1]
serve_flags_ok(serve_part, "compose.yaml rollout")
ray_part = rcmd.split("ray start", 1)[-1].split("&&", 1)[0].split()
ray_flags_ok(ray_part, "compose.yaml rollout")
targets = set()
for p in roll.get("ports", []):
    targets.add(str(p.get("target")) if isinstance(p, dict) else str(p).rsplit(":", 1)[-1].split("/")[0])
check({"50051", "8000"} <= targets, f"compose.yaml: rollout must publish 50051 and 8000 (has {sorted(targets)})")
check(as_list(roll.get("healthcheck", {}).get("test", []))[-1:] == ["/opt/rollout-service/docker/healthcheck.py"],
      "compose.yaml: rollout healthcheck must be the image's (docker/healthcheck.py, on /healthz)")
for name, s in svcs.items():
    test = as_list(s.get("healthcheck", {}).get("test", []))
    check("/opt/rollout-service/docker/healthcheck.py" in test,
          f"compose.yaml: {name}'s healthcheck should run docker/healthcheck.py (one probe for every container)")
used = {s if isinstance(s, str) else s.get("source") for s in roll.get("secrets", [])}
check({"client_token", "admin_token"} <= used, "compose.yaml: rollout must mount secrets client_token and admin_token")
declared = base.get("secrets", {})
for s in ("client_token", "admin_token"):
    check("file" in declared.get(s, {}), f"compose.yaml: top-level secret {s} must be declared with a file")
check(roll.get("depends_on", {}).get("ray-head", {}).get("condition") == "service_healthy",
      "compose.yaml: rollout must wait for a healthy ray-head")

# ---------------------------------------------------------------- compose.cpu.yaml
cpu = yaml.load(Path("docker/compose.cpu.yaml").read_text(), Loader=Loader)
csv = cpu.get("services", {})
for name in ("ray-head", "ray-worker", "rollout"):
    b = csv.get(name, {}).get("build") or {}
    check(b.get("dockerfile") == "docker/Dockerfile.cpu", f"compose.cpu.yaml: {name} must build docker/Dockerfile.cpu")
    check((Path("docker") / b.get("context", ".") / b.get("dockerfile", "-")).resolve().is_file(),
          f"compose.cpu.yaml: {name}'s Dockerfile does not exist")
check(csv.get("ray-worker", {}).get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") == [],
      "compose.cpu.yaml: ray-worker must reset the GPU reservation")
check(str(csv.get("rollout", {}).get("environment", {}).get("GPUS_PER_ENGINE")) == "0",
      "compose.cpu.yaml: rollout must ask for 0 GPUs per engine")

# ---------------------------------------------------------------- .dockerignore
ignore_lines = [ln.strip() for ln in Path(".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
for must in (".venv", "runs", ".git", "__pycache__", "*.log"):
    check(any(ln.rstrip("/").endswith(must) for ln in ignore_lines), f".dockerignore: {must} is not excluded")


def ignore_regex(pattern):
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


rules = [(ln.startswith("!"), ignore_regex(ln.lstrip("!").strip("/"))) for ln in ignore_lines]


def ignored(path):
    parts = Path(path).parts
    hit = False
    for negate, rx in rules:
        if any(rx.fullmatch("/".join(parts[:k])) for k in range(1, len(parts) + 1)):
            hit = not negate
    return hit


# ---------------------------------------------------------------- Dockerfiles
gpu_pin = next((d for d in tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
                if d.startswith("vllm==")), None)


def instructions(text):
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if cur and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


dockerfiles = sorted(glob.glob("docker/Dockerfile*"))
check(len(dockerfiles) >= 2, "docker/: expected Dockerfile.gpu and Dockerfile.cpu")
for df in dockerfiles:
    ins = instructions(Path(df).read_text())
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args.setdefault(k.strip(), v.strip().strip('"'))
    froms = [rest for word, rest in ins if word == "FROM"]
    check(froms, f"{df}: no FROM")
    for f in froms:
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), f.split()[0])
        check("$" not in image, f"{df}: FROM {f}: unresolved build argument")
        name, tag = (image.rsplit(":", 1) + [""])[:2] if ":" in image.split("/")[-1] else (image, "")
        check("@sha256:" in image or (tag and tag != "latest"), f"{df}: FROM {image} is not pinned to a tag")
        if df.endswith(".gpu"):
            check(name.endswith("vllm/vllm-openai"), f"{df}: FROM {image} is not the official vLLM image")
            check(gpu_pin is not None and tag.split("-")[0] == "v" + gpu_pin.split("==")[1],
                  f"{df}: FROM {image} does not match pyproject's gpu extra ({gpu_pin})")
    exposed = {p.split("/")[0] for word, rest in ins if word == "EXPOSE" for p in rest.split()}
    check({"50051", "8000"} <= exposed, f"{df}: must EXPOSE 50051 and 8000 (has {sorted(exposed)})")
    hcs = [rest for word, rest in ins if word == "HEALTHCHECK"]
    check(hcs and "NONE" not in hcs[-1].upper().split() and "/opt/rollout-service/docker/healthcheck.py" in hcs[-1],
          f"{df}: no HEALTHCHECK by docker/healthcheck.py")
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    for step in ("deps", "project", "user"):
        check(f"bash docker/image.sh {step}" in runs, f"{df}: should run `bash docker/image.sh {step}` (shared steps)")
    ep = [rest for word, rest in ins if word == "ENTRYPOINT"]
    check(ep and "rollout-service" in ep[-1], f"{df}: ENTRYPOINT must be rollout-service")
    cmd = [rest for word, rest in ins if word == "CMD"]
    check(cmd and '"serve"' in cmd[-1] and '"0.0.0.0"' in cmd[-1], f"{df}: CMD must be serve --host 0.0.0.0 ...")
    if cmd:
        serve_flags_ok(cmd[-1], f"{df} CMD")
    users = [rest for word, rest in ins if word == "USER"]
    check(users and users[-1].split(":")[0] not in ("root", "0"), f"{df}: should end as a non-root USER")
    for word, rest in ins:
        if word not in ("COPY", "ADD"):
            continue
        toks = [t for t in rest.split() if not t.startswith("--")]
        if any(t.startswith("--from") for t in rest.split()):
            continue
        for src in toks[:-1]:
            p = Path(src)
            check(p.exists(), f"{df}: {word} {src}: no such path in the repository")
            if src not in (".", "./"):
                check(not ignored(src), f"{df}: {word} {src}: excluded by .dockerignore")
    for word, rest in ins:
        for script in re.findall(r"(scripts/[\w./-]+\.sh)", rest) if word == "RUN" else []:
            check(Path(script).is_file(), f"{df}: RUN uses {script}, which does not exist")
check(not ignored("README.md") and not ignored("pyproject.toml"), ".dockerignore excludes files the build needs")
hc = Path("docker/healthcheck.py")
check(hc.is_file() and "http://127.0.0.1:8000/healthz" in hc.read_text(),
      "docker/healthcheck.py must exist and probe http://127.0.0.1:8000/healthz by default")
# What both images share is one text: user, ports, health check, entrypoint, command (the secrets' paths)
MARK = "# ---- Shared by both images"
tails = {df: Path(df).read_text().partition(MARK) for df in dockerfiles}
for df, (_, mark, tail) in tails.items():
    check(mark, f"{df}: no '{MARK}' section (the part both Dockerfiles share)")
    check("USER" in tail and "HEALTHCHECK" in tail and "ENTRYPOINT" in tail and "CMD" in tail,
          f"{df}: the shared section must hold the user, health check, entrypoint and command")
if len({tail for _, _, tail in tails.values()}) > 1:
    check(False, "Dockerfile.cpu and Dockerfile.gpu differ after '" + MARK + "': keep the shared part the same text")

# ---------------------------------------------------------------- docs/deployment.md
doc = Path("docs/deployment.md")
check(doc.is_file(), "docs/deployment.md is missing")
if doc.is_file():
    # every `rollout-service serve` command in a code block (with its continuation lines)
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        if "rollout-service serve" in lines[i]:
            cmd = lines[i].split("rollout-service serve", 1)[1]
            if "`" in cmd:                   # inline code in prose: up to its closing backtick
                cmd = cmd.split("`", 1)[0]
            while lines[i].rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd += " " + lines[i]
            serve_flags_ok(cmd.split("#", 1)[0], f"docs/deployment.md line {i + 1}")
        i += 1

for e in errors:
    print("FAIL:", e)
print(f"{checked - len(errors)} of {checked} static checks passed"
      + ("" if RAY_CLI else " (Ray not installed in .venv: ray start flags not checked)"))
sys.exit(1 if errors else 0)
PY

echo "== docker compose config"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Stand-in token files: `config` must not depend on the real secrets being present.
printf 'check-client-token-0123456789\n' > "$tmp/client.token"
printf 'check-admin-token-0123456789\n' > "$tmp/admin.token"
export ROLLOUT_CLIENT_TOKEN_FILE="$tmp/client.token" ROLLOUT_ADMIN_TOKEN_FILE="$tmp/admin.token"
if command -v docker >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
  for files in "-f docker/compose.yaml" "-f docker/compose.yaml -f docker/compose.cpu.yaml"; do
    # shellcheck disable=SC2086
    if out=$(docker compose $files config -q 2>&1); then
      echo "ok: docker compose $files config"
    else
      echo "FAIL: docker compose $files config"; echo "$out"; fail=1
    fi
  done
elif command -v docker-compose >/dev/null 2>&1; then
  # Compose v1 (end of life, but its schema check still catches structural mistakes) knows neither the
  # top-level `name` nor `!reset`: it checks the base file without `name`; compose.cpu.yaml is skipped.
  grep -v '^name:' docker/compose.yaml > "$tmp/compose.v1.yaml"
  if out=$(docker-compose --project-directory docker -f "$tmp/compose.v1.yaml" config -q 2>&1); then
    echo "ok: docker-compose (v1) config of docker/compose.yaml (without name:); compose.cpu.yaml needs Compose v2"
  else
    echo "FAIL: docker-compose (v1) config of docker/compose.yaml"; echo "$out"; fail=1
  fi
elif pc=$(command -v podman-compose || ls "${XDG_CACHE_HOME:-$HOME/.cache}/rollout-service/podman-compose/bin/podman-compose" 2>/dev/null); then
  # podman-compose (what docker/run_check.sh installs where Docker is absent) resolves both files, !reset included
  if out=$("$pc" -f docker/compose.yaml -f docker/compose.cpu.yaml config 2>&1) && ! grep -q "driver: nvidia" <<< "$out"; then
    echo "ok: podman-compose -f docker/compose.yaml -f docker/compose.cpu.yaml config (GPU reservation reset)"
  else
    echo "FAIL: podman-compose config"; echo "$out" | tail -20; fail=1
  fi
else
  echo "skipped: neither the docker compose plugin, docker-compose nor podman-compose is installed"
fi

echo "== hadolint"
if command -v hadolint >/dev/null 2>&1; then
  for df in docker/Dockerfile*; do
    # DL3008/DL3013: unpinned apt/pip packages (apt ones follow the base image; pip ones are pinned by
    # constraints files the linter cannot see).
    if hadolint --ignore DL3008 --ignore DL3013 "$df"; then echo "ok: hadolint $df"; else fail=1; fi
  done
else
  echo "skipped: hadolint is not installed"
fi

if [ "$fail" = 0 ]; then echo "docker/check.sh: all checks passed"; else echo "docker/check.sh: FAILED"; fi
if [ "$run" = 1 ]; then
  [ "$fail" = 0 ] || exit "$fail"
  exec bash docker/run_check.sh "$@"
fi
exit "$fail"
