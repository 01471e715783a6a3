"""docker/check.sh, the static checks of docker/ (fast, in the suite): compose files parse with the expected
services, ports, secrets and health checks, Dockerfiles are pinned, non-root, share their common part as one text
and copy sources that exist, and every serve / ray start flag they use exists. Building and running the images
(minutes) is docker/run_check.sh, on demand (docs/deployment.md)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docker_check_passes():
    r = subprocess.run(["bash", str(ROOT / "docker" / "check.sh")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout


def copy_tree(tmp_path):
    """A copy of what docker/check.sh reads, docker/ and docs/ writable."""
    import shutil

    for d in ("docker", "rollout_service", "docs"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "secrets"))
    for f in ("pyproject.toml", ".dockerignore", "README.md"):
        shutil.copy(ROOT / f, tmp_path / f)
    for d in ("proto", "clients", "rollout_tasks", "trainer_example", "constraints", "scripts"):
        (tmp_path / d).symlink_to(ROOT / d)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)


def check_in(tmp_path):
    return subprocess.run(["bash", str(tmp_path / "docker" / "check.sh")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_docker_check_catches_an_unknown_flag(tmp_path):
    """The check has power: a compose file using a serve flag the CLI lacks fails it."""
    copy_tree(tmp_path)
    compose = tmp_path / "docker" / "compose.yaml"
    compose.write_text(compose.read_text().replace("--tensor-parallel-size", "--tensor-paralel-size"))
    r = check_in(tmp_path)
    assert r.returncode != 0 and "tensor-paralel-size" in r.stdout + r.stderr, r.stdout + r.stderr


def test_docker_check_catches_images_that_drift_apart(tmp_path):
    """What both images share (user, ports, health check, entrypoint, secrets) is one text: the GPU image, which
    cannot be built here, gets what the CPU image's run proves."""
    copy_tree(tmp_path)
    gpu = tmp_path / "docker" / "Dockerfile.gpu"
    gpu.write_text(gpu.read_text().replace("/run/secrets/admin_token", "/run/secrets/admin"))
    r = check_in(tmp_path)
    assert r.returncode != 0 and "differ after" in r.stdout, r.stdout + r.stderr


def test_healthcheck_script(tmp_path):
    """docker/healthcheck.py, the one probe of every container: 0 on a 2xx answer, 1 with the reason otherwise."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 503)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    script = [sys.executable, str(ROOT / "docker" / "healthcheck.py")]
    try:
        ok = subprocess.run(script, env={"ROLLOUT_HEALTHCHECK_URL": base + "/healthz"}, capture_output=True, text=True)
        bad = subprocess.run(script + [base + "/readyz"], capture_output=True, text=True)
    finally:
        server.shutdown()
    closed = subprocess.run(script + [base + "/healthz"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert bad.returncode == 1 and "503" in bad.stderr
    assert closed.returncode == 1 and "healthcheck" in closed.stderr


def test_run_check_script_parses():
    """docker/run_check.sh (builds and runs the images; minutes, so on demand) is valid bash with its options."""
    r = subprocess.run(["bash", "-n", str(ROOT / "docker" / "run_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", str(ROOT / "docker" / "run_check.sh"), "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and "--stack" in r.stdout and "--no-cache" in r.stdout, r.stdout + r.stderr


def test_engine_actors_do_not_inherit_the_front_ends_lifeline():
    """Found running the compose stack: the front end handed its engine actors ROLLOUT_SERVICE_FRONT_END (its own
    pid); in the worker container that pid was another process, so the actor's lifeline SIGKILLed the worker's
    raylet. Everything else ROLLOUT_* / VLLM_* still reaches the actors."""
    from rollout_service.engine import lifeline
    from rollout_service.engine.ray_engine import actor_env

    env = {lifeline.ENV: "7:12345", "ROLLOUT_SERVICE_HOME": "/models", "VLLM_CPU_KVCACHE_SPACE": "2", "HOME": "/root"}
    assert actor_env(env) == {"ROLLOUT_SERVICE_HOME": "/models", "VLLM_CPU_KVCACHE_SPACE": "2"}
