import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session", autouse=True)
def _remove_in_process_staging():
    """Unit tests run weight services inside the pytest process; like a server at shutdown, drop the
    /dev/shm staging folder they created (it would otherwise stay behind until the next server sweeps it)."""
    yield
    from rollout_service.scratch import remove_scratch_root

    remove_scratch_root()
