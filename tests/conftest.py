import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
