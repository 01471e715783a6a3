"""docker/ cannot be built here (no Docker daemon); docker/check.sh checks what can be checked without one:
compose files parse with the expected services, ports, secrets and health checks, Dockerfiles are pinned,
non-root and copy sources that exist, and every serve / ray start flag they use exists."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docker_check_passes():
    r = subprocess.run(["bash", str(ROOT / "docker" / "check.sh")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout


def test_docker_check_catches_an_unknown_flag(tmp_path):
    """The check has power: a compose file using a serve flag the CLI lacks fails it."""
    import shutil

    for d in ("docker", "rollout_service", "docs"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "secrets"))
    for f in ("pyproject.toml", ".dockerignore", "README.md"):
        shutil.copy(ROOT / f, tmp_path / f)
    for d in ("proto", "clients", "rollout_tasks", "trainer_example", "constraints", "scripts"):
        (tmp_path / d).symlink_to(ROOT / d)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    compose = tmp_path / "docker" / "compose.yaml"
    compose.write_text(compose.read_text().replace("--tensor-parallel-size", "--tensor-paralel-size"))
    r = subprocess.run(["bash", str(tmp_path / "docker" / "check.sh")], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and "tensor-paralel-size" in r.stdout + r.stderr, r.stdout + r.stderr


def test_engine_actors_do_not_inherit_the_front_ends_lifeline():
    """Found running the compose stack: the front end handed its engine actors ROLLOUT_SERVICE_FRONT_END (its own
    pid); in the worker container that pid was another process, so the actor's lifeline SIGKILLed the worker's
    raylet. Everything else ROLLOUT_* / VLLM_* still reaches the actors."""
    from rollout_service.engine import lifeline
    from rollout_service.engine.ray_engine import actor_env

    env = {lifeline.ENV: "7:12345", "ROLLOUT_SERVICE_HOME": "/models", "VLLM_CPU_KVCACHE_SPACE": "2", "HOME": "/root"}
    assert actor_env(env) == {"ROLLOUT_SERVICE_HOME": "/models", "VLLM_CPU_KVCACHE_SPACE": "2"}
