"""The floor under PushWeights on this machine: a bare gRPC client stream of the same bytes over loopback.

    .venv/bin/python bench/grpc_floor.py [--mb 269] [--chunk-mb 4] [--repeats 3]

The same proto messages as a push (TensorChunks of `--chunk-mb`), a server that only counts the bytes: no
hashing, no staging copy, no engine. Whatever this takes, a real push takes more; it says whether an
end-to-end goal is reachable through Python gRPC on this hardware at all. Printed beside it: the same
stream with the client's sha256 (as rollout_client hashes) and with the server's sha256 and copy too.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from concurrent import futures

import grpc
import numpy as np

from rollout_service.api import pb, pb_grpc


class Sink(pb_grpc.RolloutServiceServicer):
    def __init__(self, work: bool):
        self.work = work

    def PushWeights(self, request_iterator, context):
        h, n, buf = hashlib.sha256(), 0, None
        for m in request_iterator:
            if m.WhichOneof("item") != "chunk":
                continue
            d = m.chunk.data
            if self.work:
                h.update(d)
                if buf is None:
                    buf = np.empty(512 << 20, dtype=np.uint8)
                buf[n:n + len(d)] = np.frombuffer(d, dtype=np.uint8)
            n += len(d)
        return pb.PushResult(num_bytes=n)


def stream(data: bytes, chunk: int, hash_client: bool):
    h = hashlib.sha256()
    yield pb.PushRequest(header=pb.PushHeader(version=1, total_bytes=len(data)))
    mv = memoryview(data)
    for off in range(0, len(data), chunk):
        piece = bytes(mv[off:off + chunk])
        if hash_client:
            h.update(piece)
        yield pb.PushRequest(chunk=pb.TensorChunk(name="w", dtype="bfloat16", shape=[len(data) // 2], offset=off,
                                                  data=piece))
    yield pb.PushRequest(trailer=pb.PushTrailer(sha256=h.hexdigest()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=269)
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = np.random.default_rng(0).integers(0, 255, args.mb << 20, dtype=np.uint8).tobytes()
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    print(f"{args.mb} MB in {args.chunk_mb} MB chunks over loopback, {args.repeats} runs each, median:")
    for label, hash_client, server_work in [("bare stream", False, False), ("+ client sha256", True, False),
                                            ("+ server sha256 and copy", True, True)]:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=opts)
        pb_grpc.add_RolloutServiceServicer_to_server(Sink(server_work), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
                stub = pb_grpc.RolloutServiceStub(ch)
                stub.PushWeights(stream(data[:1 << 20], args.chunk_mb << 20, hash_client))     # warm up
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    stub.PushWeights(stream(data, args.chunk_mb << 20, hash_client))
                    times.append(time.perf_counter() - t)
        finally:
            server.stop(None)
        med = statistics.median(times)
        print(f"  {label:<26} {med:6.3f} s  {len(data) / med / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
