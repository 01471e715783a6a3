"""The containers' health check, one file for both images and every compose service (standard library only).

    python3 /opt/rollout-service/docker/healthcheck.py [URL]

Exit 0 when URL answers 2xx within 4 s, else 1 with the reason. URL defaults to $ROLLOUT_HEALTHCHECK_URL, else
http://127.0.0.1:8000/healthz, the service's liveness path (open: it needs no token). With --tls-cert set
ROLLOUT_HEALTHCHECK_URL=https://127.0.0.1:8000/healthz; the certificate is not verified (only 127.0.0.1 is
dialled). The Ray containers pass their own URL (the head's /api/gcs_healthz, a node's /api/local_raylet_healthz).
"""
import os
import ssl
import sys
import urllib.request

url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("ROLLOUT_HEALTHCHECK_URL", "http://127.0.0.1:8000/healthz")
try:
    with urllib.request.urlopen(url, timeout=4, context=ssl._create_unverified_context()) as r:
        sys.exit(0 if 200 <= r.status < 300 else 1)
except Exception as e:  # noqa: BLE001 - any failure is "unhealthy", said in one line
    print(f"healthcheck {url}: {e}", file=sys.stderr)
    sys.exit(1)
