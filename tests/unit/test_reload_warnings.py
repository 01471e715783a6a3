"""vLLM's "Failed to load weights" warnings that every push would print (rotary embeddings, a tied LM head) are said
once at INFO instead; the same warning about any other layer still shows (engine/worker_ext.py)."""
import logging

from rollout_service.engine import worker_ext

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"


def test_expected_reload_warnings_are_explained_once_others_still_warn(caplog):
    logger = logging.getLogger(LAYERWISE)
    worker_ext._ExpectedReloadWarnings.explained = False
    with caplog.at_level(logging.INFO):
        for _ in range(3):                                   # three pushes
            for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "ParallelLMHead"):
                logger.warning("%s: Failed to load weights", layer)
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["QKVParallelLinear: Failed to load weights"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "Failed to load" in r.getMessage()]
    assert len(said) == 1 and "rotary" in said[0] and "tied" in said[0]
