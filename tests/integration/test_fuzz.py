"""Fuzzing every RPC of the shared real service: random bytes where a protobuf belongs, and well-formed
messages with random field values. Every call must end with a proper status within its deadline (never
UNKNOWN: that is an unhandled exception), and afterwards the service serves what it served before."""
import math
import random
import struct

import grpc
import pytest

from rollout_service.api import pb

SERVICE = "/rollout.v1.RolloutService/"
# Statuses a fuzzed call may end with. INTERNAL only where gRPC itself fails to parse the bytes.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS,
           grpc.StatusCode.OUT_OF_RANGE}
ROUNDS = 60
tried = {"bytes": 0, "fields": 0}


def _call(channel, method, kind, payload, timeout=60):
    """Invoke `method` with raw bytes; returns the final status code."""
    ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if kind == "unary_stream":
            for _ in channel.unary_stream(SERVICE + method, **ident)(payload, timeout=timeout):
                pass
        elif kind == "stream_unary":
            channel.stream_unary(SERVICE + method, **ident)(iter(payload), timeout=timeout)
        else:
            channel.unary_unary(SERVICE + method, **ident)(payload, timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _random_bytes(rng) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 3, 17, 64, 300])))


def _weird_float(rng) -> float:
    return rng.choice([0.0, -1.0, 1e-30, 1e30, math.inf, -math.inf, math.nan, rng.uniform(-3, 3),
                       struct.unpack("f", struct.pack("I", rng.getrandbits(32)))[0]])


def _weird_int(rng, bits=31) -> int:
    return rng.choice([0, 1, -1, 2**bits - 1, -(2**bits), rng.randint(-1000, 100_000), rng.randint(0, 60)])


def _random_text(rng) -> str:
    return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0x2FFF), 0])) for _ in range(rng.randint(0, 20)))


def random_generate(rng) -> pb.GenerateRequest:
    prompts = []
    for _ in range(rng.choice([0, 1, 2, 5, 300])):
        if rng.random() < 0.5:
            prompts.append(pb.Prompt(token_ids=[_weird_int(rng) for _ in range(rng.randint(0, 12))]))
        else:
            prompts.append(pb.Prompt(text=_random_text(rng), apply_chat_template=rng.random() < 0.5))
    sp = pb.SamplingParams(stop=[_random_text(rng) for _ in range(rng.randint(0, 2))],
                           stop_token_ids=[_weird_int(rng) for _ in range(rng.randint(0, 2))],
                           ignore_eos=rng.random() < 0.3)
    for name, value in (("temperature", _weird_float(rng)), ("top_p", _weird_float(rng)),
                        ("top_k", _weird_int(rng)), ("max_tokens", rng.choice([_weird_int(rng), rng.randint(1, 8)])),
                        ("seed", abs(_weird_int(rng, 63)))):
        if rng.random() < 0.7:
            setattr(sp, name, value)
    return pb.GenerateRequest(request_id=rng.choice(["", _random_text(rng), f"fuzz-{rng.getrandbits(40)}"]),
                              prompts=prompts, n=rng.choice([0, 1, 3, -5, 10_000]), sampling=sp,
                              min_policy_version=rng.choice([0, 0, -1, 2**62]), return_text=rng.random() < 0.5)


def random_push(rng) -> list[bytes]:
    msgs = []
    if rng.random() < 0.8:
        msgs.append(pb.PushRequest(header=pb.PushHeader(
            version=_weird_int(rng, 62), target=rng.choice([0, 1, 2, 7]), total_bytes=abs(_weird_int(rng, 40)),
            sha256=rng.choice(["", "00" * 32, _random_text(rng)]), in_flight=rng.choice([0, 1, 2, 3, 9]),
            partial=rng.random() < 0.5)))
    for _ in range(rng.randint(0, 4)):
        msgs.append(pb.PushRequest(chunk=pb.TensorChunk(
            name=rng.choice(["model.norm.weight", "lm_head.weight", _random_text(rng)]),
            dtype=rng.choice(["float32", "bfloat16", "int8", "", _random_text(rng)]),
            shape=[_weird_int(rng) for _ in range(rng.randint(0, 3))], offset=abs(_weird_int(rng, 40)),
            data=_random_bytes(rng))))
    rng.shuffle(msgs)
    return [m.SerializeToString() for m in msgs]


def random_load(rng) -> pb.LoadWeightsRequest:
    return pb.LoadWeightsRequest(version=_weird_int(rng, 62), path=rng.choice(["", "/", "/etc/passwd", "/nonexistent",
                                                                                "../../x", _random_text(rng)]),
                                 partial=rng.random() < 0.5, in_flight=rng.choice([0, 1, 2, 3, 9]),
                                 target=rng.choice([0, 1, 2, 7]))


CASES = {"Generate": ("unary_stream", lambda rng: random_generate(rng).SerializeToString()),
         "GetStatus": ("unary_unary", lambda rng: pb.GetStatusRequest().SerializeToString()),
         "PushWeights": ("stream_unary", random_push),
         "UpdateDraft": ("stream_unary", random_push),
         "LoadWeights": ("unary_unary", lambda rng: random_load(rng).SerializeToString())}


@pytest.mark.parametrize("method", list(CASES))
def test_fuzzed_calls_end_with_a_proper_status(client, method):
    rng = random.Random(f"fuzz-{method}")
    kind, make = CASES[method]
    before = client.status()
    seen = {}
    for i in range(ROUNDS):
        if i % 2:
            payload = make(rng)
            tried["fields"] += 1
        else:
            raw = _random_bytes(rng)
            payload = [raw, _random_bytes(rng)] if kind == "stream_unary" else raw
            tried["bytes"] += 1
        code, details = _call(client.channel, method, kind, payload)
        seen[code] = seen.get(code, 0) + 1
        parse_error = code == grpc.StatusCode.INTERNAL and "deserializ" in details.lower()
        assert code in ALLOWED or parse_error, f"{method} answered {code}: {details!r} to {payload!r}"[:2000]
        if code != grpc.StatusCode.OK:
            assert details, f"{method}: {code} without a message"
    after = client.status()
    assert after.ready and after.policy_version == before.policy_version
    assert after.draft_version == before.draft_version
    assert len(client.generate_all([[1, 2, 3]], n=2, max_tokens=4)[0]) == 2
    print(f"{method}: {ROUNDS} fuzzed calls -> {({c.name: n for c, n in seen.items()})}")
