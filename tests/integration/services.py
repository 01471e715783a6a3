"""Services of the integration tests' own: the arguments every test service shares, `running_service` for a
test or module that needs a service with other settings, and `wait_for`."""
import contextlib
import time
from pathlib import Path

from rollout_client.launcher import ServiceProcess

# The KV cache: 0.25 GiB holds 256k tokens of the tiny models (2 layers, one KV head of 64, float32: 1 KiB a token),
# 128k beside a drafter of the same shape, against 16k for 32 sequences of 512; an engine zero-fills it all at start.
SERVICE_ARGS = ["--max-queue", "64", "--max-model-len", "512", "--kv-cache-gb", "0.25", "--dtype", "float32",
                "--max-num-seqs", "32"]


@contextlib.contextmanager
def running_service(model, log_path, *extra_args: str, clean_exit: bool = True, **kw):
    """A real service on `model` with SERVICE_ARGS and `extra_args` (ServiceProcess keywords in `kw`): the log's
    tail printed when it fails to start, stopped at the end, its exit code 0 required unless `clean_exit` is False
    (a test that kills it itself)."""
    svc = ServiceProcess(str(model), extra_args=SERVICE_ARGS + list(extra_args), log_path=log_path, **kw)
    try:
        svc.start()
    except Exception:
        print(Path(log_path).read_text(errors="replace")[-5000:])
        raise
    try:
        yield svc
    finally:
        code = svc.stop()
    assert code == 0 or not clean_exit, f"the service did not exit cleanly (code {code}); see {log_path}"


def wait_for(pred, timeout: float, what: str):
    """Poll `pred` until it returns something truthy (returned); fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
