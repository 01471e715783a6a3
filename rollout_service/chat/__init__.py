"""Chat for agents: OpenAI chat requests checked (request.py), rendered into token ids through the model's chat
template, exactly across turns (render.py), and samples parsed back into assistant messages with tool calls and
reasoning by vLLM's own parsers (parse.py). template.py: this service's tool-aware template for the embedded model.
Blocking work throughout: callers run it in the tokenizer thread."""
