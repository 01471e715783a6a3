"""vLLM's per-layer "Failed to load weights" warnings during our reloads (engine/worker_ext.py): the ones every push
would print (rotary embeddings, a tied LM head) are explained once; other layers a push left out are one
warning line per push, not one per layer; outside our reloads vLLM's warning passes unchanged.

The loggers here are the test's own, handed to worker_ext: the session's other tests import libraries that reconfigure
logging (vLLM's own config; AReaL replaces logging's manager and root, so a lookup by name gives another object than
the one vLLM's module holds), and the checks must not depend on what they did."""
import logging

import pytest

from rollout_service.engine import worker_ext


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def loggers(monkeypatch):
    """(vLLM's layerwise logger, worker_ext's own logger, what reached them): both private, both into one handler."""
    said = _Said()
    layerwise, ours = (logging.getLogger(f"test_reload_warnings.{n}") for n in ("layerwise", "worker_ext"))
    for lg in (layerwise, ours):
        lg.propagate, lg.disabled, lg.handlers = False, False, [said]
        lg.setLevel(logging.NOTSET)
    monkeypatch.setattr(worker_ext, "_layerwise_logger", lambda: layerwise)
    monkeypatch.setattr(worker_ext, "log", ours)
    monkeypatch.setattr(worker_ext, "_explained", False)
    return layerwise, said


def finalize(logger, *layers):
    return lambda: [logger.warning("%s: Failed to load weights", layer) for layer in layers]


def test_expected_reload_warnings_are_explained_once_others_summarized(loggers):
    layerwise, said = loggers
    for _ in range(3):                                           # three full pushes
        kept = worker_ext._finalize_noted(finalize(layerwise, "RotaryEmbedding", "Llama3RotaryEmbedding",
                                                   "ParallelLMHead"))
        assert kept == ["RotaryEmbedding", "Llama3RotaryEmbedding", "ParallelLMHead"]
    worker_ext._finalize_noted(finalize(layerwise, "RotaryEmbedding", "QKVParallelLinear", "QKVParallelLinear",
                                        "RMSNorm"))
    layerwise.warning("%s: Failed to load weights", "Outside")   # not one of our reloads
    said = [r.getMessage() for r in said.records]
    assert len(said) == 3, said                                  # the explanation once, the partial push once, vLLM's
    assert "rotary" in said[0] and "tied" in said[0] and "are not shown" in said[0]
    assert said[1].startswith("this push carried no tensors for 3 layers") and "QKVParallelLinear x2" in said[1]
    assert "RMSNorm x1" in said[1] and "Rotary" not in said[1]
    assert said[2] == "Outside: Failed to load weights"


def test_collected_where_a_logging_config_disabled_or_quieted_the_layerwise_logger(loggers):
    layerwise, said = loggers
    layerwise.disabled = True
    layerwise.setLevel(logging.ERROR)
    kept = worker_ext._finalize_noted(finalize(layerwise, "RMSNorm"))
    assert kept == ["RMSNorm"]
    assert [r.getMessage() for r in said.records] == [
        "this push carried no tensors for 1 layers, which keep their previous weights (as a partial push intends): "
        "RMSNorm x1"]
    assert layerwise.disabled and layerwise.level == logging.ERROR         # put back as it was


def test_the_real_layerwise_logger_is_the_one_vllm_warns_on():
    from vllm.model_executor.model_loader.reload import layerwise
    assert worker_ext._layerwise_logger() is layerwise.logger
