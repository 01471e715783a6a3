"""The words of the wire, server side, named once: every module that speaks of an in-flight mode, a weight
target, a finish reason or a tensor dtype takes it from here. server/convert.py maps them to and from the
proto's enums (rollout.v1: IN_FLIGHT_<MODE>, TARGET_<TARGET>, FINISH_REASON_<REASON>); the HTTP dialects and
the weights package use the names themselves."""
from __future__ import annotations

IN_FLIGHT_MODES = ("abort", "wait", "keep")   # PushHeader.in_flight: what in-flight requests do at a commit
DEFAULT_IN_FLIGHT = "wait"                    # IN_FLIGHT_UNSPECIFIED
TARGETS = ("policy", "drafter", "adapter")    # PushHeader.target: which weights a push replaces (adapter: LoRA)
DEFAULT_TARGET = "policy"                     # TARGET_UNSPECIFIED
FINISH_REASONS = ("stop", "length", "abort")  # Sample.finish_reason

# TensorChunk.dtype: the names the contract uses, each with its safetensors header code and bytes per element
DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
ITEMSIZE = {name: size for name, (_, size) in DTYPES.items()}
SAFETENSORS_CODE = {name: code for name, (code, _) in DTYPES.items()}
FROM_SAFETENSORS_CODE = {code: name for name, (code, _) in DTYPES.items()}
