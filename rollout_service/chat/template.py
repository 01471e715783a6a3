"""This service's chat template for the models it prepares (the embedded SmolLM2 and the tests' tiny models): SmolLM2's
ChatML, token for token, for conversations without tools or reasoning; with them, Hermes-style tools (Qwen2.5 and
Qwen3 write them so): the tools' JSON in the system turn, each call as `<tool_call>\n{"name": ..., "arguments": ...}
\n</tool_call>` (what vLLM's `hermes` tool parser reads), tool results in a user turn as `<tool_response>` blocks, an
assistant's reasoning as `<think>...</think>` (vLLM's `qwen3` reasoning parser). `enable_thinking=False` (a
chat_template_kwargs) closes an empty think block in the generation prompt, as Qwen3's template does."""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOL_PARSER = "hermes"             # vLLM's parser for the calls this template writes
REASONING_PARSER = "qwen3"         # and for its <think> blocks

TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = '" + DEFAULT_SYSTEM + "' -%}{%- set rest = messages -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- set reasoning = message.get('reasoning_content') or message.get('reasoning') -%}"
    "{%- if reasoning -%}{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{- message.get('content') or '' }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{%- if message.get('content') or not loop.first %}{{- '\\n' }}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif -%}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + (message.get('content') or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message.get('content') or '') + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def is_ours(tokenizer) -> bool:
    """Whether a tokenizer renders chats with this template (the `auto` parsers apply then)."""
    return getattr(tokenizer, "chat_template", None) == TEMPLATE


def install(model_dir: Path) -> bool:
    """Give a prepared model directory this template (its chat_template.jinja, written atomically) where it has
    another: models prepared before the template existed. True when it wrote it."""
    path = Path(model_dir) / "chat_template.jinja"
    if path.is_file() and path.read_text() == TEMPLATE:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(TEMPLATE)
    os.replace(tmp, path)
    log.info("installed the service's tool-aware chat template in %s", model_dir)
    return True
