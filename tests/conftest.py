import functools
import os
import re
from pathlib import Path

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


# Session services that several modules share (tests/integration/conftest.py): under pytest-xdist the modules that
# use one run on the same worker, in their order, so that it starts once.
SHARED_SERVICES = ("spec_service", "tool_service")


@functools.lru_cache(maxsize=None)
def _scope(module: str) -> str:
    """The xdist scope of a test module: the first shared service its text names, else the module itself."""
    try:
        text = (Path(__file__).parent.parent / module).read_text()
    except OSError:
        return module
    return next((name for name in SHARED_SERVICES if re.search(rf"\b{name}\b", text)), module)


# The heaviest scopes first (LPT: the two workers finish together), measured in one process on 2026-12-07 (seconds;
# a stale figure only unbalances the split). The Ray module leads: its engine actors are the suite's largest
# footprint, and run first on a worker they meet none of that worker's idle session services (beside the other
# worker's services they once ran the machine out of its 24 GB).
FIRST = "tests/integration/test_ray.py"
SCOPE_SECONDS = {"spec_service": 390, "tests/integration/test_quantized.py": 89, "tool_service": 60,
                 "tests/integration/test_faults.py": 61, "tests/integration/test_lora.py": 59,
                 "tests/integration/test_moe.py": 52, "tests/integration/test_transfer_faults.py": 45,
                 "tests/integration/test_trainer.py": 39, "tests/integration/test_trainer_eagle3.py": 33,
                 "tests/integration/test_lifeline_real.py": 33, "tests/integration/test_areal_client.py": 27,
                 "tests/integration/test_calculator_trainer.py": 25, "tests/integration/test_tied_push.py": 22,
                 "tests/integration/test_security.py": 21}


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the modules sharing a session service in one scope, the scopes in SCOPE_SECONDS'
    order (the Ray module first), the rest in xdist's order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    def rank(scope: str) -> tuple:
        return (scope != FIRST, -SCOPE_SECONDS.get(scope, 0))

    class SharedServiceScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:
            """The next scope by rank (ties in xdist's order) instead of the queue's first."""
            order = {scope: i for i, scope in enumerate(self.workqueue)}
            self.workqueue.move_to_end(min(self.workqueue, key=lambda s: (rank(s), order[s])), last=False)
            super()._assign_work_unit(node)

    return SharedServiceScheduling(config, log)
