"""vLLM's per-layer "Failed to load weights" warnings during our reloads (engine/worker_ext.py): the ones every push
would print (rotary embeddings, a tied LM head) are explained once; other layers a push left out are one
warning line per push, not one per layer; outside our reloads vLLM's warning passes unchanged."""
import logging

import pytest

from rollout_service.engine import worker_ext

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"


@pytest.fixture(autouse=True)
def _vllm_logging_as_is(request):
    """vLLM configures its loggers on import (its own handler, no propagation, its level), which other tests of the
    session may have done: the checks read what reaches the root logger, so undo that here and restore it after."""
    loggers = [logging.getLogger(n) for n in ("vllm", LAYERWISE)]
    saved = [(lg.propagate, lg.disabled, lg.level, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        lg.propagate, lg.disabled, lg.handlers = True, False, []
        lg.setLevel(logging.NOTSET)
    yield
    for lg, (propagate, disabled, level, handlers) in zip(loggers, saved):
        lg.propagate, lg.disabled, lg.handlers = propagate, disabled, handlers
        lg.setLevel(level)


def finalize(*layers):
    logger = logging.getLogger(LAYERWISE)
    return lambda: [logger.warning("%s: Failed to load weights", layer) for layer in layers]


def test_expected_reload_warnings_are_explained_once_others_summarized(caplog):
    worker_ext._explained = False
    with caplog.at_level(logging.INFO):
        for _ in range(3):                                   # three full pushes
            kept = worker_ext._finalize_noted(finalize("RotaryEmbedding", "Llama3RotaryEmbedding", "ParallelLMHead"))
            assert kept == ["RotaryEmbedding", "Llama3RotaryEmbedding", "ParallelLMHead"]
        worker_ext._finalize_noted(finalize("RotaryEmbedding", "QKVParallelLinear", "QKVParallelLinear", "RMSNorm"))
        logging.getLogger(LAYERWISE).warning("%s: Failed to load weights", "Outside")   # not one of our reloads
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said                            # the explanation once, the partial push once, vLLM's own
    assert "rotary" in said[0] and "tied" in said[0] and "are not shown" in said[0]
    assert said[1].startswith("this push carried no tensors for 3 layers") and "QKVParallelLinear x2" in said[1]
    assert "RMSNorm x1" in said[1] and "Rotary" not in said[1]
    assert said[2] == "Outside: Failed to load weights"
