"""What docker/run_check.sh checks from the host, with the project's Python client (run by .venv/bin/python).

    python docker/host_checks.py --grpc 127.0.0.1:50051 --http http://127.0.0.1:8000 \
        --token-file client.token --admin-token-file admin.token CHECK [CHECK ...]

Checks, in the order given:
  ready       wait for GET /readyz without a token to answer 200 (a probe's view); reports the seconds waited and
              whether a 503 before it said anything beyond {"status": "not ready"}
  http-auth   /readyz, /healthz open; /metrics, /v1/status 401 without a token and 200 with it
  generate    a Generate from the client: 2 prompts x 2 samples, each with tokens and log-probs
  push        PushWeights of the default model's own weights (rollout_service.models.prepare_default_model(),
              converted on the host as in the image) as the next policy version; then samples at that version
  status      GetStatus: engines, their state and location (the Ray node's address with --ray-address)
  wait-unready  wait until /readyz stops answering 200 (an engine or node went away)

Each check prints one JSON line {"check", "ok", ...}; the exit status is the number of failed checks.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def http_get(base: str, path: str, token: str = "") -> tuple[int, str]:
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def alive(a) -> bool:
    """--alive: a command that prints "true" while the container runs (no command: assume it does)."""
    if not a.alive:
        return True
    import shlex
    import subprocess

    r = subprocess.run(shlex.split(a.alive), capture_output=True, text=True)
    return r.stdout.strip() == "true"


def check_ready(a, client) -> dict:
    t0, said_more, seen_503 = time.monotonic(), None, False
    while time.monotonic() - t0 < a.timeout:
        if not alive(a):
            return {"ok": False, "error": f"the container stopped after {time.monotonic() - t0:.0f} s"}
        code, body = http_get(a.http, "/readyz")
        if code == 200:
            return {"ok": said_more is None, "waited_s": round(time.monotonic() - t0, 1), "saw_503": seen_503,
                    **({"leaked": said_more} if said_more else {})}
        if code == 503:
            seen_503 = True
            if json.loads(body) != {"status": "not ready"}:
                said_more = body
        time.sleep(1)
    return {"ok": False, "error": f"/readyz not 200 after {a.timeout:.0f} s (last {code})"}


def check_unready(a, client) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < a.timeout:
        code, _ = http_get(a.http, "/readyz")
        if code != 200:
            return {"ok": True, "after_s": round(time.monotonic() - t0, 1), "readyz": code}
        time.sleep(0.5)
    return {"ok": False, "error": f"/readyz stayed 200 for {a.timeout:.0f} s"}


def check_http_auth(a, client) -> dict:
    got = {p: http_get(a.http, p)[0] for p in ("/healthz", "/readyz", "/metrics", "/v1/status")}
    got |= {p + " (token)": http_get(a.http, p, a.token)[0] for p in ("/metrics", "/v1/status")}
    want = {"/healthz": 200, "/readyz": 200, "/metrics": 401, "/v1/status": 401, "/metrics (token)": 200,
            "/v1/status (token)": 200}
    return {"ok": got == want, "codes": got}


def check_generate(a, client) -> dict:
    t0 = time.monotonic()
    groups = client.generate_all(["What is 2+3?", "Name a colour."], n=2, max_tokens=16, temperature=1.0, chat=True,
                                 return_text=True, timeout=300)
    samples = [s for g in groups for s in g]
    ok = len(samples) == 4 and all(s is not None and len(s.token_ids) > 0 and len(s.logprobs) == len(s.token_ids)
                                   for s in samples)
    return {"ok": ok, "seconds": round(time.monotonic() - t0, 2), "samples": len(samples),
            "policy_version": sorted({s.policy_version for s in samples}),
            "example": samples[0].text[:60] if samples and samples[0] is not None else None}


def check_push(a, client) -> dict:
    from safetensors.torch import load_file

    from rollout_service.models import prepare_default_model

    tensors = {}
    for f in sorted(prepare_default_model().glob("*.safetensors")):
        tensors |= load_file(str(f))
    version = client.status().policy_version + 1
    t0 = time.monotonic()
    r = client.push_weights(tensors, version=version, mode="wait", timeout=600)
    push_s = time.monotonic() - t0
    after = client.generate_all(["What is 2+3?"], n=1, max_tokens=8, chat=True, timeout=300)[0][0]
    return {"ok": r.version == version and after.policy_version == version and client.status().policy_version
            == version, "version": r.version, "bytes": r.num_bytes, "seconds": round(push_s, 2),
            "pause_s": round(r.pause_s, 3), "served_after": after.policy_version}


def check_status(a, client) -> dict:
    s = client.status()
    from rollout_client.api import pb

    engines = [{"id": e.id, "state": pb.EngineState.Name(e.state), "location": e.location, "restarts": e.restarts,
                "policy_version": e.policy_version} for e in s.engines]
    return {"ok": bool(engines), "engines": engines, "policy_version": s.policy_version}


CHECKS = {"ready": check_ready, "wait-unready": check_unready, "http-auth": check_http_auth,
          "generate": check_generate, "push": check_push, "status": check_status}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grpc", required=True)
    ap.add_argument("--http", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--admin-token-file", required=True)
    ap.add_argument("--timeout", type=float, default=900.0, help="ready / wait-unready: seconds to wait")
    ap.add_argument("--alive", help="ready: a command printing true while the container runs (stop waiting else)")
    ap.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    a = ap.parse_args()
    a.token = open(a.token_file).read().strip()
    admin = open(a.admin_token_file).read().strip()
    from rollout_client import RolloutClient

    failed = 0
    with RolloutClient(a.grpc, token=a.token, admin_token=admin) as client:
        for name in a.checks:
            try:
                out = CHECKS[name](a, client)
            except Exception as e:  # noqa: BLE001 - a failed check is reported, the others still run
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            failed += not out["ok"]
            print(json.dumps({"check": name, **out}), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
