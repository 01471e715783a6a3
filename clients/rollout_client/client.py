"""RolloutClient (blocking) and AsyncRolloutClient (asyncio): the only code that knows the RPCs."""
from __future__ import annotations

from typing import AsyncIterator, Iterator

import grpc

from rollout_client.connection import Auth, open_channel
from rollout_client.types import AssistantMessage, PushResult, Sample, build_request
from rollout_client.weights import PACK_BYTES, peft_adapter, push_stream
from rollout_client.wire import MODES, TARGETS
from rollout_client.api import pb, pb_grpc


class RolloutClient:
    """Blocking client.

        with RolloutClient("127.0.0.1:50051") as c:
            for s in c.generate([[1, 2, 3]], n=4, max_tokens=64):
                print(s.prompt_index, s.sample_index, s.token_ids, s.logprobs.sum())
    """

    def __init__(self, target: str, *, max_message_mb: int = 64, token: str | None = None,
                 admin_token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        """token / admin_token: bearer tokens (default: env ROLLOUT_AUTH_TOKEN / ROLLOUT_ADMIN_TOKEN); the admin
        token is needed for push_weights, update_draft and load_weights. tls_*: see connection.open_channel."""
        self._target = target
        self.auth = Auth(token, admin_token)
        self.channel = open_channel(target, max_message_mb=max_message_mb, tls_ca=tls_ca, tls_cert=tls_cert,
                                    tls_key=tls_key)
        self.stub = pb_grpc.RolloutServiceStub(self.channel)

    def wait_ready(self, timeout: float = 300.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def generate(self, prompts, *, timeout: float | None = None, **kwargs) -> Iterator[Sample]:
        """Stream samples as they finish (with stream_tokens=True also their token deltas, Sample.delta set, before
        each whole sample). kwargs: see rollout_client.build_request."""
        for m in self.stub.Generate(build_request(prompts, **kwargs), timeout=timeout, metadata=self.auth.data()):
            yield Sample.from_proto(m)

    def generate_all(self, prompts, **kwargs) -> list[list[Sample]]:
        """Every sample, grouped: result[prompt_index][sample_index]."""
        n = kwargs.get("n", 1) or 1
        out: list[list[Sample | None]] = [[None] * n for _ in prompts]
        for s in self.generate(prompts, **kwargs):
            if not s.delta:
                out[s.prompt_index][s.sample_index] = s
        return out  # type: ignore[return-value]

    def chat_step(self, episodes, **kwargs) -> list:
        """One turn of every unfinished episode (rollout_client.Episode): one Generate, one chat prompt per episode
        with its exact tokens so far; each episode records its sample. Returns the episodes that ran. kwargs: see
        build_request (max_tokens, temperature, ...; n is 1)."""
        live = [e for e in episodes if not e.done]
        if live:
            kwargs.setdefault("session_id", live[0].session_id)
            for s in self.generate([e.prompt() for e in live], n=1, **kwargs):
                if not s.delta:
                    live[s.prompt_index].record(s)
        return live

    def render(self, episode_or_chat, *, return_text: bool = False, timeout: float | None = None) -> pb.RenderResult:
        """The token ids the server renders a chat prompt into (an Episode's next prompt, or a pb.ChatPrompt)."""
        chat = episode_or_chat.prompt().chat if hasattr(episode_or_chat, "prompt") else episode_or_chat
        return self.stub.Render(pb.RenderRequest(chat=chat, return_text=return_text), timeout=timeout,
                                metadata=self.auth.data())

    def parse(self, token_ids, chat: pb.ChatPrompt | None = None, *, prompt_token_ids=(),
              timeout: float | None = None) -> AssistantMessage:
        """Generated token ids -> the assistant message the server's parsers read (chat: its tools and tool_choice)."""
        req = pb.ParseRequest(token_ids=[int(t) for t in token_ids], chat=chat or pb.ChatPrompt(),
                              prompt_token_ids=[int(t) for t in prompt_token_ids])
        return AssistantMessage.from_proto(self.stub.Parse(req, timeout=timeout, metadata=self.auth.data()))

    def status(self, timeout: float | None = 10.0) -> pb.Status:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout, metadata=self.auth.data())

    def scale_engines(self, engines: int, timeout: float | None = None) -> pb.Status:
        """Grow or shrink the engine pool (admin token); returns once the pool has `engines` engines."""
        return self.stub.ScaleEngines(pb.ScaleRequest(engines=engines), timeout=timeout, metadata=self.auth.admin())

    def push_weights(self, weights, version: int, *, mode: str = "wait", partial: bool = False, dtype=None,
                     chunk_bytes: int = 4 << 20, pack_bytes: int = PACK_BYTES, timeout: float | None = None,
                     checksum: str = "trailer") -> PushResult:
        """Push policy weights (an nn.Module or a name->tensor dict), streamed in chunks.

        mode: what in-flight samples do at commit: "wait" (sync RL), "keep" (async RL), "abort".
        dtype: cast tensors while sending (e.g. torch.bfloat16 to match a bf16 checkpoint).
        checksum: "trailer" hashes while streaming (one pass over the tensors); "header" hashes first.
        pack_bytes: tensors up to this size go several to a message (TensorBatch); 0 for servers older than it.
        """
        stream = push_stream(weights, version, target=TARGETS["policy"], mode=mode, partial=partial, dtype=dtype,
                             chunk_bytes=chunk_bytes, checksum=checksum, pack_bytes=pack_bytes)
        return PushResult.from_proto(self.stub.PushWeights(stream, timeout=timeout, metadata=self.auth.admin()))

    def update_draft(self, weights, version: int, *, mode: str = "wait", partial: bool = False, dtype=None,
                     chunk_bytes: int = 4 << 20, pack_bytes: int = PACK_BYTES, timeout: float | None = None,
                     checksum: str = "trailer") -> PushResult:
        """Push drafter weights (versioned independently of the policy)."""
        stream = push_stream(weights, version, target=TARGETS["drafter"], mode=mode, partial=partial, dtype=dtype,
                             chunk_bytes=chunk_bytes, checksum=checksum, pack_bytes=pack_bytes)
        return PushResult.from_proto(self.stub.UpdateDraft(stream, timeout=timeout, metadata=self.auth.admin()))

    def load_weights(self, path: str, version: int, *, target: str = "policy", mode: str = "wait",
                     partial: bool = False, timeout: float | None = None, base_version: int = 0) -> PushResult:
        """Have the server load safetensors from `path` (a file or directory below one of its --weights-root).
        base_version: the files hold a delta against that version (rollout_client.delta.save_delta writes one)."""
        req = pb.LoadWeightsRequest(version=version, path=path, partial=partial, in_flight=MODES[mode],
                                    target=TARGETS["drafter" if target == "drafter" else "policy"],
                                    base_version=base_version)
        return PushResult.from_proto(self.stub.LoadWeights(req, timeout=timeout, metadata=self.auth.admin()))

    def push_adapter(self, name: str, adapter, version: int, *, config=None, dtype=None,
                     chunk_bytes: int = 4 << 20, pack_bytes: int = PACK_BYTES,
                     timeout: float | None = None) -> PushResult:
        """Push a LoRA adapter as version `version` of policy `name` (Generate(policy=name) samples it). adapter: a
        PEFT model (its adapter's tensors and config are sent, never the base weights), or a name->tensor dict in
        PEFT's naming with `config` (PEFT's adapter_config as a dict or JSON text). Needs the admin token or a
        tenant token whose policies include `name`."""
        tensors, text = adapter_payload(adapter, config)
        stream = push_stream(tensors, version, target=TARGETS["adapter"], dtype=dtype, chunk_bytes=chunk_bytes,
                             adapter=name, adapter_config=text, pack_bytes=pack_bytes)
        return PushResult.from_proto(self.stub.PushWeights(stream, timeout=timeout, metadata=self.auth.admin()))

    def load_adapter(self, name: str, path: str, version: int, *, timeout: float | None = None) -> PushResult:
        """Have the server load a PEFT adapter directory (below one of its --weights-root) as version `version` of
        policy `name`."""
        req = pb.LoadWeightsRequest(version=version, path=path, target=TARGETS["adapter"], adapter=name)
        return PushResult.from_proto(self.stub.LoadWeights(req, timeout=timeout, metadata=self.auth.admin()))

    def unload_adapter(self, name: str, timeout: float | None = None) -> pb.AdapterStatus:
        """Stop serving adapter `name` (its samples in flight finish first)."""
        return self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=timeout,
                                       metadata=self.auth.admin())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncRolloutClient:
    """asyncio client with the same methods as RolloutClient (awaitable / async iterators)."""

    def __init__(self, target: str, *, max_message_mb: int = 64, token: str | None = None,
                 admin_token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        self.auth = Auth(token, admin_token)
        self.channel = open_channel(target, max_message_mb=max_message_mb, tls_ca=tls_ca, tls_cert=tls_cert,
                                    tls_key=tls_key, aio=True)
        self.stub = pb_grpc.RolloutServiceStub(self.channel)

    async def wait_ready(self, timeout: float = 300.0) -> None:
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def generate(self, prompts, *, timeout: float | None = None, **kwargs) -> AsyncIterator[Sample]:
        call = self.stub.Generate(build_request(prompts, **kwargs), timeout=timeout, metadata=self.auth.data())
        try:
            async for m in call:
                yield Sample.from_proto(m)
        finally:
            call.cancel()   # no-op when the stream completed; aborts server-side work when abandoned

    async def generate_all(self, prompts, **kwargs) -> list[list[Sample]]:
        n = kwargs.get("n", 1) or 1
        out: list[list[Sample | None]] = [[None] * n for _ in prompts]
        async for s in self.generate(prompts, **kwargs):
            if not s.delta:
                out[s.prompt_index][s.sample_index] = s
        return out  # type: ignore[return-value]

    async def chat_step(self, episodes, **kwargs) -> list:
        """RolloutClient.chat_step on asyncio."""
        live = [e for e in episodes if not e.done]
        if live:
            kwargs.setdefault("session_id", live[0].session_id)
            async for s in self.generate([e.prompt() for e in live], n=1, **kwargs):
                if not s.delta:
                    live[s.prompt_index].record(s)
        return live

    async def render(self, episode_or_chat, *, return_text: bool = False,
                     timeout: float | None = None) -> pb.RenderResult:
        chat = episode_or_chat.prompt().chat if hasattr(episode_or_chat, "prompt") else episode_or_chat
        return await self.stub.Render(pb.RenderRequest(chat=chat, return_text=return_text), timeout=timeout,
                                      metadata=self.auth.data())

    async def parse(self, token_ids, chat: pb.ChatPrompt | None = None, *, prompt_token_ids=(),
                    timeout: float | None = None) -> AssistantMessage:
        req = pb.ParseRequest(token_ids=[int(t) for t in token_ids], chat=chat or pb.ChatPrompt(),
                              prompt_token_ids=[int(t) for t in prompt_token_ids])
        return AssistantMessage.from_proto(await self.stub.Parse(req, timeout=timeout, metadata=self.auth.data()))

    async def status(self, timeout: float | None = 10.0) -> pb.Status:
        return await self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout, metadata=self.auth.data())

    async def scale_engines(self, engines: int, timeout: float | None = None) -> pb.Status:
        return await self.stub.ScaleEngines(pb.ScaleRequest(engines=engines), timeout=timeout,
                                            metadata=self.auth.admin())

    async def push_weights(self, weights, version: int, *, mode: str = "wait", partial: bool = False,
                           dtype=None, chunk_bytes: int = 4 << 20, pack_bytes: int = PACK_BYTES,
                           timeout: float | None = None, checksum: str = "trailer") -> PushResult:
        stream = push_stream(weights, version, target=TARGETS["policy"], mode=mode, partial=partial, dtype=dtype,
                             chunk_bytes=chunk_bytes, checksum=checksum, pack_bytes=pack_bytes)
        reply = await self.stub.PushWeights(stream, timeout=timeout, metadata=self.auth.admin())
        return PushResult.from_proto(reply)

    async def update_draft(self, weights, version: int, *, mode: str = "wait", partial: bool = False,
                           dtype=None, chunk_bytes: int = 4 << 20, pack_bytes: int = PACK_BYTES,
                           timeout: float | None = None, checksum: str = "trailer") -> PushResult:
        stream = push_stream(weights, version, target=TARGETS["drafter"], mode=mode, partial=partial, dtype=dtype,
                             chunk_bytes=chunk_bytes, checksum=checksum, pack_bytes=pack_bytes)
        reply = await self.stub.UpdateDraft(stream, timeout=timeout, metadata=self.auth.admin())
        return PushResult.from_proto(reply)

    async def load_weights(self, path: str, version: int, *, target: str = "policy", mode: str = "wait",
                           partial: bool = False, timeout: float | None = None, base_version: int = 0) -> PushResult:
        req = pb.LoadWeightsRequest(version=version, path=path, partial=partial, in_flight=MODES[mode],
                                    target=TARGETS["drafter" if target == "drafter" else "policy"],
                                    base_version=base_version)
        reply = await self.stub.LoadWeights(req, timeout=timeout, metadata=self.auth.admin())
        return PushResult.from_proto(reply)

    async def push_adapter(self, name: str, adapter, version: int, *, config=None, dtype=None,
                           chunk_bytes: int = 4 << 20, pack_bytes: int = PACK_BYTES,
                     timeout: float | None = None) -> PushResult:
        tensors, text = adapter_payload(adapter, config)
        stream = push_stream(tensors, version, target=TARGETS["adapter"], dtype=dtype, chunk_bytes=chunk_bytes,
                             adapter=name, adapter_config=text, pack_bytes=pack_bytes)
        return PushResult.from_proto(await self.stub.PushWeights(stream, timeout=timeout,
                                                                 metadata=self.auth.admin()))

    async def load_adapter(self, name: str, path: str, version: int, *, timeout: float | None = None) -> PushResult:
        req = pb.LoadWeightsRequest(version=version, path=path, target=TARGETS["adapter"], adapter=name)
        return PushResult.from_proto(await self.stub.LoadWeights(req, timeout=timeout, metadata=self.auth.admin()))

    async def unload_adapter(self, name: str, timeout: float | None = None) -> pb.AdapterStatus:
        return await self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=timeout,
                                             metadata=self.auth.admin())

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()



def adapter_payload(adapter, config=None) -> tuple[dict, str]:
    """(tensors, adapter_config.json text) of a PEFT model, or of a PEFT-named tensor dict and its `config` (a dict
    or JSON text)."""
    import json

    if hasattr(adapter, "peft_config"):
        return peft_adapter(adapter)
    if config is None:
        raise ValueError("config: PEFT's adapter_config (a dict or JSON text) is needed with a tensor dict")
    return dict(adapter), config if isinstance(config, str) else json.dumps(config, default=str)
