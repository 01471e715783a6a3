"""One real service per test session: a tiny random Llama (SmolLM2's tokenizer), real vLLM engine,
real gRPC over a loopback socket. Engine start costs ~40 s, so every test here shares it; so do the tests of a
speculative service (`spec_service`), which is stopped after the last test that uses it."""
import contextlib
import re
from pathlib import Path

import pytest
from rollout_client import RolloutClient
from rollout_client.launcher import ServiceProcess

from tests.integration.services import running_service
from tests.tiny_models import build_tiny_model, perturbed_copy


def pytest_collection_modifyitems(config, items):
    """Every test here is an integration test (real vLLM): `pytest -m "not integration"` runs the fast suite."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


# Session services that several modules share but not the whole session: each is stopped after the last test (of those
# selected, in their order) that uses it, not at the session's end, so that it does not sit idle beside later services.
STOPPED_AFTER_LAST_USER = ("spec_service", "tool_service")
_last_user: dict[str, str] = {}                 # fixture name -> node id of the last test that uses it
_stoppers: dict[str, contextlib.ExitStack] = {}  # fixture name -> what stops it, while it runs


def pytest_collection_finish(session):
    for item in session.items:
        for name in STOPPED_AFTER_LAST_USER:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


# No test may hold a server's event loop longer than this (server/loop_watchdog.py measures it; /metrics
# exports the largest lag since the server became ready). Checked for the shared service after every test,
# and for every other server when the test stops it.
LOOP_LAG_LIMIT_S = 0.5
_held: list[str] = []              # servers found over the limit when stopped, not yet reported


def loop_lag_max(svc: ServiceProcess) -> float | None:
    """The longest the server's own work held its event loop so far (None: it does not answer). Stalls in which
    the loop sat idle and none of its threads ran (the machine overloaded, the process waiting for a CPU) are
    not its code's: the watchdog logs them as such and leaves them out."""
    status, body = svc.http_get("/metrics")
    m = re.search(r"^rollout_event_loop_held_max_seconds (\S+)$", body, re.MULTILINE) if status == 200 else None
    return float(m[1]) if m else None


def _where_held(svc: ServiceProcess) -> str:
    """The watchdog's last warning in the server's log (the stack it sampled, any garbage collection), so a
    failure in CI, where the log is gone, still names the code that held the loop."""
    try:
        lines = Path(svc.log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if "event loop was held for" in line or "has been held for" in line]
    if not starts:
        return ""
    block = lines[starts[-1]:starts[-1] + 2 + 2 * 8]
    return "\n  the watchdog's last warning:\n    " + "\n    ".join(block)


_stop = ServiceProcess.stop


def _stop_checking_the_loop(self, *a, **kw):
    running = self.proc is not None and self.proc.poll() is None and not getattr(self, "lag_reported", False)
    lag = loop_lag_max(self) if running else None
    if lag is not None and lag > LOOP_LAG_LIMIT_S:
        _held.append(f"a server (log {self.log_path}) held its event loop for {lag:.2f} s{_where_held(self)}")
    return _stop(self, *a, **kw)


ServiceProcess.stop = _stop_checking_the_loop


@pytest.fixture(autouse=True)
def _loop_never_held(request):
    """Fail the test during which a server's event loop was held longer than LOOP_LAG_LIMIT_S (its log
    names the code: the watchdog warns with the loop thread's stack)."""
    yield
    found = [_held.pop() for _ in range(len(_held))]
    if "service" in request.fixturenames:
        svc = request.getfixturevalue("service")
        lag = loop_lag_max(svc)
        if lag is not None and lag > LOOP_LAG_LIMIT_S and not getattr(svc, "lag_reported", False):
            svc.lag_reported = True                   # fail the test that did it, not every one after
            found.append(f"the shared service (log {svc.log_path}) held its event loop for {lag:.2f} s"
                         f"{_where_held(svc)}")
    if found:
        pytest.fail(f"over {LOOP_LAG_LIMIT_S} s with the event loop held: " + "; ".join(found), pytrace=False)


@pytest.fixture(autouse=True)
def _stop_services_after_their_last_user(request):
    """Torn down before _loop_never_held (set up after it), so that a service stopped here that held its event loop
    fails the test that stopped it; a service that does not exit cleanly fails it too."""
    yield
    for name, nodeid in _last_user.items():
        if nodeid == request.node.nodeid and name in _stoppers:
            _stoppers.pop(name).close()


@pytest.fixture(scope="session", autouse=True)
def _loop_never_held_by_session_servers():
    yield
    assert not _held, "; ".join(_held)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def service(tiny_model, tmp_path_factory):
    # LoadWeights reads only below --weights-root: this session's temporary folders (tests write there)
    with running_service(tiny_model, tmp_path_factory.mktemp("logs") / "service.log",
                         "--weights-root", str(tmp_path_factory.getbasetemp())) as svc:
        yield svc


@pytest.fixture(scope="session")
def client(service):
    with RolloutClient(service.target) as c:
        yield c


EAGLE3_PROMPTS = [[1, 504, 3458, 314, 260], [1, 1046, 2683, 77, 8, 9]]


@pytest.fixture(scope="session")
def eagle3_head(tiny_model, tmp_path_factory):
    """An EAGLE-3 head for the tiny target, trained (seconds) with the code of `rollout-service prepare-drafter
    --kind eagle3` on the target's own samples of EAGLE3_PROMPTS (4 tokens each, top-k 4: what
    test_speculation.py's checks sample): the tiny target is a random network, so like any drafter the head can only
    learn the continuations it is shown. Shared by test_speculation.py and test_trainer_eagle3.py."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.drafting.eagle3 import prepare_eagle3

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    data = []
    for prompt in EAGLE3_PROMPTS:
        out = model.generate(torch.tensor([prompt] * 96), do_sample=True, max_new_tokens=4, min_new_tokens=4,
                             top_k=4, temperature=1.0)
        data += [(prompt, row[len(prompt):].tolist()) for row in out]
    return prepare_eagle3(str(tiny_model), data, tmp_path_factory.mktemp("drafters") / "eagle3", epochs=8,
                          lr=3e-3, draft_vocab_size=256, holdout=8, progress=False)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    """The served model's weights as they start, in transformers (float32): the tests' independent forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def http(service):
    """An HTTP client on the shared service's HTTP port."""
    import httpx

    with httpx.Client(base_url=service.http, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def policy(tiny_model, client):
    """The trainer side: a model whose weights mirror what the shared service serves. Restored at the end of the
    module (test_weights.py, test_weight_transfer.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    yield model
    v = client.status().policy_version + 1
    client.push_weights(original, v)


@pytest.fixture(scope="session")
def noisy_drafter(tiny_model, tmp_path_factory):
    """A noisy copy of the target: accepts often, rejects often enough to exercise resampling."""
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("drafters") / "noisy", scale=0.1, seed=1)


class SpecService:
    """The shared speculative service, its client, the drafter identical to the target it started with (`identical`),
    and the drafter it serves now (`drafter`, a directory, at `draft_version`)."""

    def __init__(self, svc: ServiceProcess, client: RolloutClient, identical: Path):
        self.svc, self.client, self.identical = svc, client, identical
        self.drafter, self.draft_version = str(identical), 0

    def pushed(self, drafter: Path, version: int) -> None:
        """Record a drafter a test committed with UpdateDraft."""
        self.drafter, self.draft_version = str(drafter), version

    def serve(self, drafter: Path) -> int:
        """Make `drafter` the served one (UpdateDraft at the next version unless it serves already); its version."""
        if self.drafter != str(drafter):
            import torch
            from transformers import AutoModelForCausalLM

            version = self.client.status().draft_version + 1
            self.client.update_draft(AutoModelForCausalLM.from_pretrained(drafter, dtype=torch.float32), version)
            self.pushed(drafter, version)
        return self.draft_version


@pytest.fixture(scope="session")
def spec_service(tiny_model, tmp_path_factory):
    """A speculative service (draft_model, k = 3 every step: --k-control fixed) shared by test_speculation.py and
    test_tokens_and_topk.py, started with a drafter identical to the target at drafter version 0. A test that needs
    another drafter serving pushes it (SpecService.serve) and checks versions relative to the one it got."""
    identical = perturbed_copy(tiny_model, tmp_path_factory.mktemp("drafters") / "identical", scale=0.0)
    with contextlib.ExitStack() as stack:
        svc = stack.enter_context(running_service(
            tiny_model, tmp_path_factory.mktemp("logs") / "spec.log", "--speculation", "draft_model", "--draft-model",
            str(identical), "--num-speculative-tokens", "3", "--k-control", "fixed"))
        c = stack.enter_context(RolloutClient(svc.target))
        _stoppers["spec_service"] = stack
        yield SpecService(svc, c, identical)
        _stoppers.pop("spec_service", None)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> Path:
    """A tiny model trained (seconds) to call the calculator tool on TOOL_PROBLEMS and answer after its result: real
    engine output with real tool calls (tests/tiny_models.py build_tiny_tool_model)."""
    from tests.tiny_models import build_tiny_tool_model

    return build_tiny_tool_model(tmp_path_factory.mktemp("models") / "tiny-tools")


@pytest.fixture(scope="session")
def tool_service(tool_model, tmp_path_factory):
    """A service on the tool model (tools parsed by vLLM's hermes parser: --tool-call-parser auto), shared by
    test_agents.py and test_framework_agents.py, stopped after the last test that uses it."""
    with contextlib.ExitStack() as stack:
        svc = stack.enter_context(running_service(tool_model, tmp_path_factory.mktemp("logs") / "tools.log"))
        _stoppers["tool_service"] = stack
        yield svc
        _stoppers.pop("tool_service", None)
