"""Regenerate the committed Python stubs from proto/rollout/v1/rollout.proto.

    python -m rollout_service.protogen           # rewrite clients/rollout_client/api/rollout/v1/
    python -m rollout_service.protogen --check   # exit 1 when the committed stubs are stale
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
PROTO = "rollout/v1/rollout.proto"
OUT_ROOT = REPO / "clients" / "rollout_client" / "api"
GENERATED = ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py")


def generate(out_root: Path) -> Path:
    """Run protoc into out_root; return the folder holding the generated modules."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_root.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main([
        "protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}", str(PROTO_ROOT / PROTO),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    folder = out_root / "rollout" / "v1"
    # protoc writes absolute imports (`from rollout.v1 import ...`); the stubs live inside this package.
    grpc_file = folder / "rollout_pb2_grpc.py"
    grpc_file.write_text(grpc_file.read_text().replace("from rollout.v1 import", "from . import"))
    for pkg in (out_root / "rollout", folder):
        (pkg / "__init__.py").write_text("")
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = ap.parse_args(argv)
    if not args.check:
        generate(OUT_ROOT)
        print(f"regenerated {OUT_ROOT / 'rollout' / 'v1'}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [n for n in GENERATED
                 if not (OUT_ROOT / "rollout/v1" / n).exists()
                 or not filecmp.cmp(fresh / n, OUT_ROOT / "rollout/v1" / n, shallow=False)]
    if stale:
        print(f"stale stubs: {', '.join(stale)}; run `python -m rollout_service.protogen`", file=sys.stderr)
        return 1
    print("stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
