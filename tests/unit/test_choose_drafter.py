"""Which drafter the bundled trainer starts the service with (trainer_example/train.py choose_drafter): it
asks the `rollout-service` command (rollout_client.launcher.run_command), which prepares and caches them."""
from trainer_example import drafter, train


def test_default_model_uses_the_prepared_drafter(tmp_path, monkeypatch):
    calls = []

    def fake_run(*args):             # stands in for `rollout-service prepare-drafter` (minutes at first)
        calls.append(args)
        return "/home/drafters/SmolLM2-135M-Instruct-draft_model"

    monkeypatch.setattr(train, "run_command", fake_run)
    assert train.choose_drafter(train.parse_args([]), "policy", tmp_path) == fake_run()
    assert calls[0] == ("prepare-drafter",)


def test_own_model_cuts_a_drafter_from_the_policy(tmp_path, monkeypatch):
    calls = []

    def fake_run(*args):             # `prepare-drafter --epochs 0` prints the directory it cut the drafter into
        calls.append(args)
        return args[args.index("--out") + 1]

    monkeypatch.setattr(drafter, "run_command", fake_run)
    got = train.choose_drafter(train.parse_args(["--model", "/p"]), "/p", tmp_path)
    assert got == str(tmp_path / "drafter-init")
    assert calls == [("prepare-drafter", "--model", "/p", "--out", got, "--layers", "2", "--epochs", "0")]


def test_explicit_drafter_and_no_speculation(tmp_path):
    assert train.choose_drafter(train.parse_args(["--drafter", "/d"]), "policy", tmp_path) == "/d"
    assert train.choose_drafter(train.parse_args(["--speculation", "none"]), "policy", tmp_path) is None
