"""Which drafter the bundled trainer starts the service with (trainer_example/train.py choose_drafter): it
asks the `rollout-service` command (rollout_client.launcher.run_command), which prepares and caches them."""
from trainer_example import drafter, train


def test_default_is_the_prepared_eagle3_head_and_draft_model_the_distilled_drafter(tmp_path, monkeypatch):
    calls = []

    def fake_run(*args):             # stands in for `rollout-service prepare-drafter` (minutes at first)
        calls.append(args)
        return "/home/drafters/SmolLM2-135M-Instruct-" + ("eagle3" if "eagle3" in args else "draft_model")

    monkeypatch.setattr(train, "run_command", fake_run)
    assert train.choose_drafter(train.parse_args([]), "policy", tmp_path).endswith("-eagle3")
    assert calls[-1] == ("prepare-drafter", "--kind", "eagle3")
    assert train.choose_drafter(train.parse_args(["--speculation", "draft_model"]), "policy", tmp_path).endswith(
        "-draft_model")
    assert calls[-1] == ("prepare-drafter",)
    train.choose_drafter(train.parse_args(["--model", "/p"]), "/p", tmp_path)      # an own model's head
    assert calls[-1] == ("prepare-drafter", "--kind", "eagle3", "--model", "/p")


def test_own_model_cuts_a_drafter_from_the_policy(tmp_path, monkeypatch):
    calls = []

    def fake_run(*args):             # `prepare-drafter --epochs 0` prints the directory it cut the drafter into
        calls.append(args)
        return args[args.index("--out") + 1]

    monkeypatch.setattr(drafter, "run_command", fake_run)
    got = train.choose_drafter(train.parse_args(["--model", "/p", "--speculation", "draft_model"]), "/p", tmp_path)
    assert got == str(tmp_path / "drafter-init")
    assert calls == [("prepare-drafter", "--model", "/p", "--out", got, "--layers", "2", "--epochs", "0")]


def test_explicit_drafter_and_no_speculation(tmp_path):
    assert train.choose_drafter(train.parse_args(["--drafter", "/d"]), "policy", tmp_path) == "/d"
    assert train.choose_drafter(train.parse_args(["--speculation", "none"]), "policy", tmp_path) is None
