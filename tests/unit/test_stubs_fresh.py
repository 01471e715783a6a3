from rollout_service.protogen import main


def test_committed_stubs_match_the_proto():
    assert main(["--check"]) == 0, "stale stubs: run `python -m rollout_service.protogen`"


def test_every_field_and_rpc_is_commented():
    import re
    from pathlib import Path

    lines = (Path(__file__).parents[2] / "proto/rollout/v1/rollout.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        is_field = re.match(r"^(optional |repeated )?[\w.]+ \w+ = \d+;", s) or re.match(r"^[A-Z_0-9]+ = \d+;", s)
        if s.startswith("rpc ") or is_field:
            assert lines[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {s}"
