"""Generated gRPC stubs for proto/rollout/v1/rollout.proto (and nothing else), shipped with the client so it
installs alone.

Regenerate with `python -m rollout_service.protogen`; `tests/unit/test_stubs_fresh.py` fails when the
committed stubs differ from what the .proto generates.
"""
from rollout_client.api.rollout.v1 import rollout_pb2 as pb
from rollout_client.api.rollout.v1 import rollout_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
