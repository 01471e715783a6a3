"""Register the servicer with request parsing we control.

grpc.aio parses requests before the handler runs and answers a malformed payload with UNKNOWN
("Unexpected DecodeError"), which a client cannot tell from a server bug. Here the handlers receive raw
bytes and parse them themselves: a payload that is not the method's protobuf is INVALID_ARGUMENT with
the message type named. (Found by tests/integration/test_fuzz.py.)"""
from __future__ import annotations

import inspect

import grpc
from google.protobuf import message as pbmessage
from google.protobuf.message_factory import GetMessageClass

from rollout_service.api import pb
from rollout_service.errors import ServiceError, invalid

SERVICE = pb.DESCRIPTOR.services_by_name["RolloutService"]


def _identity(b: bytes) -> bytes:
    return b


def _parse(cls, raw: bytes, max_bytes: int):
    """max_bytes: 0 for no check here."""
    if max_bytes and len(raw) > max_bytes:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"a {cls.DESCRIPTOR.name} message of {len(raw)} bytes exceeds max_message_mb="
                           f"{max_bytes / 2**20:g}; send fewer prompts per request, or smaller tensor chunks "
                           "(rollout_client: chunk_bytes=)")
    try:
        return cls.FromString(raw)
    except pbmessage.DecodeError as e:
        raise invalid(f"the request is not a valid {cls.DESCRIPTOR.full_name} protobuf ({e}); "
                      f"use the generated stubs or rollout_client") from None


def _unary_request(method, cls, max_bytes):
    async def handler(raw, context):
        try:
            request = _parse(cls, raw, max_bytes)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        return await method(request, context)

    async def stream_handler(raw, context):
        try:
            request = _parse(cls, raw, max_bytes)
        except ServiceError as e:
            await context.abort(e.code, e.message)
        if not inspect.isasyncgenfunction(method):       # streams through context.write (grpc's Health.Watch)
            await method(request, context)
            return
        async for item in method(request, context):
            yield item

    return handler, stream_handler


def _stream_request(method, cls, max_bytes):
    async def handler(raw_iterator, context):
        async def parsed():
            async for raw in raw_iterator:
                yield _parse(cls, raw, max_bytes)      # a ServiceError here ends the push like any invalid chunk
        return await method(parsed(), context)
    return handler


def add_servicer(servicer, server: grpc.aio.Server, max_message_bytes: int = 0, service=SERVICE) -> None:
    """max_message_bytes: requests above it are RESOURCE_EXHAUSTED naming max_message_mb (gRPC's own limit,
    set higher, stays the hard cap: its message names no setting). service: the service descriptor
    (grpc.health.v1.Health is registered this way too: its stock handlers answer UNKNOWN to a bad payload)."""
    handlers = {}
    for m in service.methods:
        cls, out = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
        fn = getattr(servicer, m.name)
        kw = dict(request_deserializer=_identity, response_serializer=out.SerializeToString)
        if m.client_streaming and not m.server_streaming:
            handlers[m.name] = grpc.stream_unary_rpc_method_handler(_stream_request(fn, cls, max_message_bytes), **kw)
        elif m.server_streaming and not m.client_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(_unary_request(fn, cls, max_message_bytes)[1], **kw)
        elif not m.server_streaming:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(_unary_request(fn, cls, max_message_bytes)[0], **kw)
        else:
            raise NotImplementedError(f"{m.full_name}: bidirectional streams are not served")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
