"""Which drafter the bundled trainer starts the service with (trainer_example/train.py choose_drafter)."""
import sys

from trainer_example import train


def test_default_model_prepares_the_distilled_drafter_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_SERVICE_HOME", str(tmp_path / "home"))
    calls = []

    def fake_run(cmd, check):          # stands in for the minutes-long `rollout-service prepare-drafter`
        calls.append(cmd)
        out = tmp_path / "home" / "drafters" / "SmolLM2-135M-Instruct-draft_model"
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(train.subprocess, "run", fake_run)
    args = train.parse_args([])
    first = train.choose_drafter(args, "policy", tmp_path / "run")
    assert calls == [[sys.executable, "-m", "rollout_service.cli", "prepare-drafter"]]
    assert first.endswith("drafters/SmolLM2-135M-Instruct-draft_model")
    assert train.choose_drafter(args, "policy", tmp_path / "run") == first and len(calls) == 1   # cached


def test_explicit_drafter_and_no_speculation(tmp_path):
    assert train.choose_drafter(train.parse_args(["--drafter", "/d"]), "policy", tmp_path) == "/d"
    assert train.choose_drafter(train.parse_args(["--speculation", "none"]), "policy", tmp_path) is None
