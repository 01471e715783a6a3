"""One real service per test session: a tiny random Llama (SmolLM2's tokenizer), real vLLM engine,
real gRPC over a loopback socket. Engine start costs ~40 s, so every test here shares it."""
import time
from pathlib import Path

import pytest

from rollout_client import RolloutClient
from rollout_service.launcher import ServiceProcess
from rollout_service.models import build_tiny_model

SERVICE_ARGS = ["--max-queue", "64", "--max-model-len", "512", "--kv-cache-gb", "1", "--dtype", "float32",
                "--max-num-seqs", "32"]


def wait_for(pred, timeout: float, what: str):
    """Poll `pred` until it returns something truthy (returned); fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def service(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "service.log"
    # LoadWeights reads only below --weights-root: this session's temporary folders (tests write there)
    roots = ["--weights-root", str(tmp_path_factory.getbasetemp())]
    svc = ServiceProcess(str(tiny_model), extra_args=SERVICE_ARGS + roots, log_path=log)
    try:
        svc.start()
    except Exception:
        print(Path(log).read_text()[-5000:])
        raise
    yield svc
    assert svc.stop() == 0, f"service did not exit cleanly; see {log}"


@pytest.fixture(scope="session")
def client(service):
    with RolloutClient(service.target) as c:
        yield c
