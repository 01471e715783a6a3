import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`-n 2 --dist loadfile`, the README's test command) each worker, and every service and
    engine it starts, runs on its own share of the CPUs: an engine binds its OpenMP threads to the CPUs it may use
    (engine/cpu_env.py), so two workers' engines do not spin on the same cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, n, i = sorted(os.sched_getaffinity(0)), int(count), int(worker.removeprefix("gw"))
    if len(cpus) >= n > 1:
        share = len(cpus) // n
        os.sched_setaffinity(0, cpus[i * share:(i + 1) * share])


_pin_xdist_worker()


@pytest.fixture(scope="session", autouse=True)
def _remove_in_process_staging():
    """Unit tests run weight services inside the pytest process; like a server at shutdown, drop the
    /dev/shm staging folder they created (it would otherwise stay behind until the next server sweeps it)."""
    yield
    from rollout_service.scratch import remove_scratch_root

    remove_scratch_root()

