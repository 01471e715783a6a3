"""Fuzz every RPC of a real service and count the answers (on demand; tests/integration/test_fuzz.py runs a
seeded sample of the same cases in CI).

    .venv/bin/python bench/fuzz.py [--calls 10000] [--seed 0] [--model DIR]

Starts `rollout-service serve` on a tiny model (or the given one) with --weights-root pointing at a folder of
hostile entries (a FIFO, a socket and a directory named *.safetensors, symlinks to /dev/zero and out of the
root, garbage and empty files, a copy of the served checkpoint), then sends --calls calls spread over every
RPC (Generate, GetStatus, PushWeights, UpdateDraft, LoadWeights, ScaleEngines, InitWeightTransfer,
TransferWeights, CloseWeightTransfer, grpc.health.v1 Check), each one of: random bytes, a valid message with
flipped bits, random field values (PushWeights: tensors alone and packed in TensorBatch messages), for
LoadWeights hostile paths (devices, FIFOs, /proc files, directories, symlinks out of the roots,
very long and NUL-containing paths), and for InitWeightTransfer hostile rendezvous
addresses (schemes, ports, paths, addresses the engines may not reach, ports where the service's own HTTP
server listens, NaN and huge timeouts) and set-ups nobody completes (each must end at its timeout). It fails
(exit 1) on any UNKNOWN or INTERNAL answer, a call without a message, a set-up that outlasts its timeout, the
service not ready at a check (every 100 calls), or a seeded Generate that differs after the run from before it.
ScaleEngines payloads that would start engines (2..64) are skipped and counted: starting engines is what
the RPC is for, and each costs a minute and a GB here; so are InitWeightTransfer payloads the server would
accept with a timeout above 3 s (each would wait it out). Prints a markdown table of answers per RPC and
status.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import random
import shutil
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import grpc

from rollout_service.api import pb

SERVICE = "/rollout.v1.RolloutService/"
HEALTH = "/grpc.health.v1.Health/Check"
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SEEDED = {"prompts": [[1, 504, 3458, 28], [2, 17]], "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 1234}


# ---- values -------------------------------------------------------------------------------------------
def random_bytes(rng) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 3, 17, 64, 300])))


def weird_float(rng) -> float:
    return rng.choice([0.0, -1.0, 1e-30, 1e-6, 0.005, 0.01, 2.0, 2.5, 1e30, math.inf, -math.inf, math.nan,
                       rng.uniform(-3, 3), struct.unpack("f", struct.pack("I", rng.getrandbits(32)))[0]])


def weird_int(rng, bits=31) -> int:
    return rng.choice([0, 1, -1, 2**bits - 1, -(2**bits), rng.randint(-1000, 100_000), rng.randint(0, 60)])


def random_text(rng) -> str:
    return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0x2FFF), 0]))
                   for _ in range(rng.randint(0, 20)))


def flip_bits(rng, data: bytes) -> bytes:
    if not data:
        return random_bytes(rng)
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(b) * 8)
        b[i // 8] ^= 1 << (i % 8)
    return bytes(b)


# ---- hostile paths ------------------------------------------------------------------------------------
def make_hostile_root(root: Path, checkpoint: Path, committable: bool = True) -> tuple[list[str], str | None]:
    """Fill `root` (a --weights-root) with hostile entries. Returns (paths worth sending, in and out of it;
    a valid checkpoint copy inside it, which a LoadWeights may commit: same values as `checkpoint`).
    committable=False leaves root/model empty (returned as None): one of the paths, root/../<root>/model, resolves
    there, and a fuzzed LoadWeights with a good version would commit it (a service whose weights must not change)."""
    root.mkdir(parents=True, exist_ok=True)
    outside = Path(tempfile.mkdtemp(prefix="fuzz-outside-"))
    shutil.copy(checkpoint / "model.safetensors", outside / "model.safetensors")
    for d in ("fifo", "dirs", "sock", "links", "model"):
        (root / d).mkdir(exist_ok=True)
    if not (root / "fifo" / "x.safetensors").exists():
        os.mkfifo(root / "fifo" / "x.safetensors")
    (root / "dirs" / "y.safetensors").mkdir(exist_ok=True)
    if not (root / "sock" / "z.safetensors").exists():
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(root / "sock" / "z.safetensors"))
    for name, target in (("zero.safetensors", "/dev/zero"), ("escape.safetensors", str(outside / "model.safetensors")),
                         ("outdir", str(outside)), ("loop", str(root / "links" / "loop"))):
        if not os.path.lexists(root / "links" / name):
            os.symlink(target, root / "links" / name)
    (root / "empty.safetensors").write_bytes(b"")
    (root / "garbage.safetensors").write_bytes(b"\xff" * 8 + b"{not json")
    (root / "huge-header.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    if committable:
        shutil.copy(checkpoint / "model.safetensors", root / "model" / "model.safetensors")   # valid, same values
    inside = [str(root / p) for p in ("fifo", "fifo/x.safetensors", "dirs", "dirs/y.safetensors", "sock",
                                      "sock/z.safetensors", "links/zero.safetensors", "links/escape.safetensors",
                                      "links/outdir", "links/loop", "empty.safetensors", "garbage.safetensors",
                                      "huge-header.safetensors", "", ".")]
    system = ["/dev/zero", "/dev/random", "/dev/stdin", "/dev/null", "/proc/self/mem", "/proc/1/environ",
              "/proc/kmsg", "/sys/kernel", "/etc/shadow", "/etc/passwd", "/", "/nonexistent", "../../etc/passwd",
              "~", "relative.safetensors", "/" + "a/" * 3000, "/" + "b" * 300, str(root) + "/\0x",
              "/tmp/a\0b.safetensors", str(root) + "/../" + root.name + "/model", str(outside)]
    return inside + system, str(root / "model") if committable else None


# ---- messages -----------------------------------------------------------------------------------------
def random_generate(rng) -> pb.GenerateRequest:
    prompts = []
    for _ in range(rng.choice([0, 1, 2, 5, 300])):
        if rng.random() < 0.5:
            prompts.append(pb.Prompt(token_ids=[weird_int(rng) for _ in range(rng.randint(0, 12))]))
        else:
            prompts.append(pb.Prompt(text=random_text(rng), apply_chat_template=rng.random() < 0.5))
        if rng.random() < 0.2:
            prompts[-1].partial.CopyFrom(random_partial(rng))
    sp = pb.SamplingParams(stop=[random_text(rng) for _ in range(rng.randint(0, 2))],
                           stop_token_ids=[weird_int(rng) for _ in range(rng.randint(0, 2))],
                           ignore_eos=rng.random() < 0.3)
    for name, value in (("temperature", weird_float(rng)), ("top_p", weird_float(rng)),
                        ("top_k", weird_int(rng)), ("max_tokens", rng.choice([weird_int(rng), rng.randint(1, 8)])),
                        ("seed", abs(weird_int(rng, 63)))):
        if rng.random() < 0.7:
            setattr(sp, name, value)
    return pb.GenerateRequest(request_id=rng.choice(["", random_text(rng), f"fuzz-{rng.getrandbits(40)}"]),
                              prompts=prompts, n=rng.choice([0, 1, 3, -5, 10_000]), sampling=sp,
                              min_policy_version=rng.choice([0, 0, -1, 2**62]), return_text=rng.random() < 0.5,
                              top_logprobs=rng.choice([0, 0, 1, 5, 20, 21, -1, weird_int(rng)]),
                              stream_tokens=rng.random() < 0.5, return_partial=rng.random() < 0.5,
                              session_id=rng.choice(["", "", random_text(rng), f"conv-{rng.randint(0, 5)}",
                                                     "s" * rng.choice([256, 257, 5000])]),
                              return_routed_experts=rng.random() < 0.2)     # a dense policy: INVALID_ARGUMENT


def random_partial(rng) -> pb.PartialSample:
    """Tokens to continue: as often malformed (lengths, spans, log-probs, top-k rows) as well-formed."""
    n = rng.choice([0, 1, 3, 200])
    k = rng.choice([0, 0, 2])
    spans = rng.choice([[(0, 0)], [], [(1, 0), (2, rng.randint(0, n + 1))], [(weird_int(rng), weird_int(rng))]])
    return pb.PartialSample(
        token_ids=[rng.choice([rng.randint(1, 100), weird_int(rng)]) for _ in range(n)],
        logprobs=[rng.choice([-1.0, weird_float(rng)]) for _ in range(n + rng.choice([0, 0, -1, 1]))],
        version_spans=[pb.VersionSpan(policy_version=v, first_token=t) for v, t in spans],
        top_token_ids=[rng.randint(0, 100) for _ in range(n * k)], top_logprobs=[-2.0] * (n * k),
        routed_experts=pb.RoutedExperts(ids=random_bytes(rng), shape=[weird_int(rng) for _ in range(3)],
                                        dtype=rng.choice(["uint8", "uint16", random_text(rng)]))
        if rng.random() < 0.2 else None)


def valid_generate(rng) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompts=[pb.Prompt(token_ids=[1, 2, 3])], n=2,
                             sampling=pb.SamplingParams(max_tokens=4, temperature=1.0, seed=rng.getrandbits(16)),
                             top_logprobs=rng.choice([0, 3, 20]), stream_tokens=rng.random() < 0.5,
                             return_partial=rng.random() < 0.5,
                             session_id=rng.choice(["", f"conv-{rng.randint(0, 3)}"]))
    if rng.random() < 0.3:                       # continue a partial sample of two tokens
        k = req.top_logprobs
        req.prompts[0].partial.CopyFrom(pb.PartialSample(
            token_ids=[5, 6], logprobs=[-1.0, -2.0], version_spans=[pb.VersionSpan(policy_version=0)],
            top_token_ids=[7] * (2 * k), top_logprobs=[-3.0] * (2 * k)))
    return req


def random_push(rng) -> list[pb.PushRequest]:
    msgs = []
    if rng.random() < 0.8:
        msgs.append(pb.PushRequest(header=pb.PushHeader(
            version=weird_int(rng, 62), target=rng.choice([0, 1, 2, 7]), total_bytes=abs(weird_int(rng, 40)),
            sha256=rng.choice(["", "00" * 32, random_text(rng)]), in_flight=rng.choice([0, 1, 2, 3, 9]),
            partial=rng.random() < 0.5)))
    def chunk() -> pb.TensorChunk:
        return pb.TensorChunk(
            name=rng.choice(["model.norm.weight", "lm_head.weight", random_text(rng)]),
            dtype=rng.choice(["float32", "bfloat16", "int8", "", random_text(rng)]),
            shape=[weird_int(rng) for _ in range(rng.randint(0, 3))], offset=abs(weird_int(rng, 40)),
            data=random_bytes(rng))

    for _ in range(rng.randint(0, 4)):               # a chunk alone, or a TensorBatch of 0-3 (0: refused)
        if rng.random() < 0.7:
            msgs.append(pb.PushRequest(chunk=chunk()))
        else:
            msgs.append(pb.PushRequest(batch=pb.TensorBatch(chunks=[chunk() for _ in range(rng.randint(0, 3))])))
    if rng.random() < 0.3:
        msgs.append(pb.PushRequest(trailer=pb.PushTrailer(sha256=rng.choice(["00" * 32, random_text(rng)]))))
    rng.shuffle(msgs)
    return msgs


def random_load(rng, paths: list[str]) -> pb.LoadWeightsRequest:
    path = rng.choice(paths + [random_text(rng), "/" + random_text(rng)])
    version = rng.choice([weird_int(rng, 62), 2**62 - 1, 2**62 - 1])      # mostly past the version check
    return pb.LoadWeightsRequest(version=version, path=path, partial=rng.random() < 0.5,
                                 in_flight=rng.choice([0, 1, 2, 3, 9]), target=rng.choice([0, 1, 2, 7]))


HOSTS = ["127.0.0.1:80", "127.0.0/1", "http://127.0.0.1", "12?.0,0.1", "", "[::1]", "127.0.0", "localhost:1",
         "10.255.255.1", "8.8.8.8", "169.254.169.254", "example.invalid", "a" * 300, "-x", "127.0.0.1/8"]
WAIT_S = 3.0          # the longest set-up a fuzzed call may wait for (longer ones are skipped, as are scale-outs)


def random_init(rng, busy_ports) -> pb.WeightTransferInit:
    """Every field of InitWeightTransfer as a hostile caller would fill it: hosts with schemes, ports, paths,
    unroutable or metadata addresses; ports out of range or where another server listens; NaN and huge
    timeouts; huge rank counts."""
    return pb.WeightTransferInit(
        backend=rng.choice(["", "auto", "gloo", "nccl", "none", random_text(rng)]),
        master_address=rng.choice(HOSTS + ["127.0.0.1", "::1", "localhost", random_text(rng)]),
        master_port=rng.choice([0, 1, 65535, 65536, 2**32 - 1, abs(weird_int(rng)), *busy_ports]),
        trainer_ranks=rng.choice([0, 1, 2, 1025, 4097, 2**32 - 1]),
        timeout_s=rng.choice([weird_float(rng), 0.5, 1.0, 1e308, -0.0]))


def valid_init(rng, busy_ports) -> pb.WeightTransferInit:
    """A set-up nobody completes (nothing listens at the port, or another server does): it ends at its timeout."""
    port = rng.choice([_free_port(), *busy_ports])
    return pb.WeightTransferInit(master_address="127.0.0.1", master_port=port, trainer_ranks=rng.choice([0, 1, 2]),
                                 timeout_s=rng.choice([0.5, 1.0]))


def random_transfer(rng) -> pb.TransferRequest:
    return pb.TransferRequest(
        version=weird_int(rng, 62), target=rng.choice([0, 1, 2, 7]), in_flight=rng.choice([0, 1, 2, 3, 9]),
        partial=rng.random() < 0.5, group_id=rng.choice(["", random_text(rng), "0" * 12]),
        tensors=[pb.TensorMeta(name=rng.choice(["model.norm.weight", "lm_head.weight", random_text(rng)]),
                               dtype=rng.choice(["float32", "bfloat16", "", random_text(rng)]),
                               shape=[weird_int(rng) for _ in range(rng.randint(0, 3))],
                               src_rank=rng.choice([0, 1, 2**32 - 1]))
                 for _ in range(rng.randint(0, 3))])


def would_wait(data: bytes) -> bool:
    """An InitWeightTransfer the server would accept with a long timeout (0: the server's, 120 s): skipped."""
    from rollout_service.hosts import host_problem

    try:
        m = pb.WeightTransferInit.FromString(data)
    except Exception:  # noqa: BLE001 - not a WeightTransferInit: the server refuses it
        return False
    return (host_problem(m.master_address) is None and 1 <= m.master_port <= 65535
            and m.trainer_ranks <= 1024 and (m.timeout_s == 0 or (math.isfinite(m.timeout_s) and m.timeout_s > WAIT_S)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# method -> (gRPC path, call kind, random message(s), valid message(s): sent as they are or with flipped bits)
def cases(paths: list[str], commit_path: str | None, busy_ports=()):
    versions = iter(range(1000, 2**40))

    def valid_load(rng):
        return pb.LoadWeightsRequest(version=next(versions), path=commit_path or "", partial=False,
                                     in_flight=pb.IN_FLIGHT_WAIT, target=pb.TARGET_POLICY)
    return {
        "Generate": (SERVICE + "Generate", "unary_stream", random_generate, valid_generate),
        "GetStatus": (SERVICE + "GetStatus", "unary_unary", lambda rng: pb.GetStatusRequest(),
                      lambda rng: pb.GetStatusRequest()),
        "PushWeights": (SERVICE + "PushWeights", "stream_unary", random_push, random_push),
        "UpdateDraft": (SERVICE + "UpdateDraft", "stream_unary", random_push, random_push),
        "LoadWeights": (SERVICE + "LoadWeights", "unary_unary", lambda rng: random_load(rng, paths),
                        valid_load if commit_path else lambda rng: random_load(rng, paths)),
        "ScaleEngines": (SERVICE + "ScaleEngines", "unary_unary",
                         lambda rng: pb.ScaleRequest(engines=rng.choice([0, 1, -1, 65, 2**31 - 1, -(2**31)])),
                         lambda rng: pb.ScaleRequest(engines=1)),
        "InitWeightTransfer": (SERVICE + "InitWeightTransfer", "unary_stream",
                               lambda rng: random_init(rng, busy_ports), lambda rng: valid_init(rng, busy_ports)),
        "TransferWeights": (SERVICE + "TransferWeights", "unary_stream", random_transfer, random_transfer),
        "CloseWeightTransfer": (SERVICE + "CloseWeightTransfer", "unary_unary",
                                lambda rng: pb.CloseWeightTransferRequest(),
                                lambda rng: pb.CloseWeightTransferRequest()),
        "Health.Check": (HEALTH, "unary_unary", lambda rng: _health(rng.choice(["", "rollout.v1.RolloutService",
                                                                                random_text(rng)])),
                         lambda rng: _health("")),
    }


def _health(service: str):
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckRequest(service=service)


def payload(rng, method: str, kind: str, make_random, make_valid):
    """(strategy, bytes or a list of bytes for client streams)."""
    strategy = rng.choice(["bytes", "bitflip", "bitflip", "fields", "fields", "valid"])
    if strategy == "bytes":
        data = [random_bytes(rng) for _ in range(rng.randint(0, 3))] if kind == "stream_unary" else random_bytes(rng)
    else:
        made = (make_random if strategy == "fields" else make_valid)(rng)   # "bitflip" flips a valid one
        msgs = made if isinstance(made, list) else [made]
        data = [m.SerializeToString() for m in msgs]
        if strategy == "bitflip":
            data = [flip_bits(rng, d) for d in data]
        if kind != "stream_unary":
            data = data[0]
    return strategy, data


def would_scale(data: bytes) -> bool:
    try:
        return 2 <= pb.ScaleRequest.FromString(data).engines <= 64
    except Exception:  # noqa: BLE001 - not a ScaleRequest: the server refuses it
        return False


def call(channel, path: str, kind: str, data, metadata, timeout: float):
    ident = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if kind == "unary_stream":
            for _ in channel.unary_stream(path, **ident)(data, timeout=timeout, metadata=metadata):
                pass
        elif kind == "stream_unary":
            channel.stream_unary(path, **ident)(iter(data), timeout=timeout, metadata=metadata)
        else:
            channel.unary_unary(path, **ident)(data, timeout=timeout, metadata=metadata)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def seeded_samples(client) -> list:
    groups = client.generate_all(SEEDED["prompts"], n=SEEDED["n"], max_tokens=SEEDED["max_tokens"],
                                 temperature=SEEDED["temperature"], seed=SEEDED["seed"])
    return [[(list(s.token_ids), [round(float(x), 4) for x in s.logprobs]) for s in g] for g in groups]


def run_fuzz(client, http_get, paths: list[str], *, calls: int, seed: int, commit_path: str | None = None,
             metadata=(), timeout: float = 60.0, log=print, busy_ports=()) -> dict:
    """Send `calls` fuzzed calls; returns {"counts": {rpc: {status: n}}, "failures": [...], "skipped": n}.
    commit_path: a checkpoint with the served values that valid LoadWeights calls commit (None: none are sent;
    a service whose weights were changed by pushes would change what it serves). busy_ports: ports where
    something listens that is not a rendezvous (the service's own HTTP port), for InitWeightTransfer to dial."""
    rng = random.Random(seed)
    table = cases(paths, commit_path, busy_ports)
    counts = {m: collections.Counter() for m in table}
    failures, skipped = [], 0
    before = seeded_samples(client)
    t0 = time.monotonic()
    for i in range(calls):
        method = list(table)[i % len(table)]
        path, kind, make_random, make_valid = table[method]
        strategy, data = payload(rng, method, kind, make_random, make_valid)
        if (method == "ScaleEngines" and would_scale(data)) or (method == "InitWeightTransfer" and would_wait(data)):
            skipped += 1
            continue
        t_call = time.monotonic()
        code, details = call(client.channel, path, kind, data, metadata, timeout)
        counts[method][code.name] += 1
        if code in FORBIDDEN or (code != grpc.StatusCode.OK and not details):
            failures.append(f"{method} ({strategy}) answered {code.name} {details!r} to {data!r}"[:600])
        if method == "InitWeightTransfer" and time.monotonic() - t_call > WAIT_S + 20:    # ends at its timeout
            failures.append(f"{method} ({strategy}) took {time.monotonic() - t_call:.0f} s: {data!r}"[:600])
        if (i + 1) % 100 == 0:
            status, _ = http_get("/readyz")
            if status != 200:
                failures.append(f"not ready (HTTP {status}) after call {i + 1}")
        if (i + 1) % 1000 == 0:
            log(f"{i + 1} calls, {time.monotonic() - t0:.0f} s, {len(failures)} failures")
    if seeded_samples(client) != before:
        failures.append("a seeded Generate returned different samples after the fuzzing than before it")
    return {"counts": {m: dict(c) for m, c in counts.items()}, "failures": failures, "skipped": skipped,
            "seconds": time.monotonic() - t0}


def render(result: dict) -> str:
    codes = sorted({c for row in result["counts"].values() for c in row})
    lines = ["| RPC | calls | " + " | ".join(f"`{c}`" for c in codes) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in codes) + " |"]
    for m, row in result["counts"].items():
        lines.append(f"| {m} | {sum(row.values()):,} | " + " | ".join(f"{row.get(c, 0):,}" for c in codes) + " |")
    total = collections.Counter()
    for row in result["counts"].values():
        total.update(row)
    lines.append(f"| all | {sum(total.values()):,} | " + " | ".join(f"{total.get(c, 0):,}" for c in codes) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="model directory (default: a tiny random Llama built here)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from rollout_client import RolloutClient
    from rollout_client.launcher import ServiceProcess

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the repository: tests/tiny_models.py
    from tests.tiny_models import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    model = Path(args.model) if args.model else build_tiny_model(work / "tiny")
    paths, commit_path = make_hostile_root(work / "root", model)
    log_path = Path("bench/results/fuzz.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    svc = ServiceProcess(str(model), log_path=log_path, extra_args=[
        "--weights-root", str(work / "root"), "--max-model-len", "512", "--kv-cache-gb", "1", "--dtype", "float32",
        "--max-queue", "64"])
    with svc, RolloutClient(svc.target) as client:
        result = run_fuzz(client, svc.http_get, paths, calls=args.calls, seed=args.seed, commit_path=commit_path,
                          busy_ports=[svc.http_port])
        _, metrics = svc.http_get("/metrics")
    lag = next((ln.split()[1] for ln in metrics.splitlines() if ln.startswith("rollout_event_loop_lag_max_seconds ")),
               "?")
    print(render(result))
    print(f"\n{sum(sum(r.values()) for r in result['counts'].values()):,} calls in {result['seconds']:.0f} s "
          f"(seed {args.seed}); payloads skipped because they would start engines (ScaleEngines) or wait over "
          f"{WAIT_S:g} s (InitWeightTransfer): {result['skipped']}; "
          f"longest event-loop lag {lag} s")
    for f in result["failures"][:50]:
        print("FAIL:", f)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
