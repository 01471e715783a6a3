"""The contract's generated stubs, as the service imports them. They live in the client package
(clients/rollout_client/api/), which the service depends on: one copy, registered once with protobuf."""
from rollout_client.api import pb, pb_grpc

__all__ = ["pb", "pb_grpc"]
