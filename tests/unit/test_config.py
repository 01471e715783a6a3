import subprocess
import sys

import pytest

from rollout_service.config import ConfigError, load_config


def test_defaults_bind_loopback():
    cfg = load_config()
    assert cfg.host == "127.0.0.1" and cfg.engines == 1 and cfg.engine.model == ""


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('engines = 2\nmax_queue = 10\n[engine]\nmax_model_len = 1024\n')
    cfg = load_config(f, max_queue=20, **{"engine.dtype": "float32", "host": None})
    assert (cfg.engines, cfg.max_queue, cfg.engine.max_model_len, cfg.engine.dtype) == (2, 20, 1024, "float32")


@pytest.mark.parametrize("text,needle", [
    ("engnes = 2\n", "engnes"),
    ("[engine]\nmax_model_length = 5\n", "max_model_length"),
    ("engines = 'two'\n", "engines"),
    ("engines = 0\n", "engines"),
    ("[engine]\ndtype = 'int8'\n", "engine.dtype"),
    ("[engine]\nweight_reload = 'double'\n", "engine.weight_reload"),
])
def test_bad_config_file_names_the_field(tmp_path, text, needle):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert needle in str(e.value)


def test_json_config_and_missing_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"grpc_port": 7000, "unknown": 1}')
    with pytest.raises(ConfigError, match="unknown"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_serve_with_bad_config_exits_2_with_message(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("max_qeue = 3\n")
    r = subprocess.run([sys.executable, "-m", "rollout_service.cli", "serve", "--config", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "max_qeue" in r.stderr


def test_k_by_batch_size_from_toml_reaches_vllm(tmp_path):
    from rollout_service.engine.vllm_engine import speculative_config

    f = tmp_path / "c.toml"
    f.write_text('[engine.speculation]\nmethod = "ngram"\nnum_speculative_tokens = 3\n'
                 'k_by_batch_size = [[1, 4, 3], [5, 16, 1], [17, 64, 0]]\n')
    sp = load_config(f).engine.speculation
    assert sp.k_by_batch_size == [(1, 4, 3), (5, 16, 1), (17, 64, 0)]
    assert speculative_config(sp)["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 16, 1], [17, 64, 0]]
    fixed = load_config(**{"engine.speculation.method": "ngram", "engine.speculation.k_control": "fixed"})
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(fixed.engine.speculation)


def test_the_kv_cache_is_sized_in_bytes_fractions_of_a_gib_included(monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE takes whole GiB (0.25 was 1 GiB, zero-filled at every engine start): on CPU the engine
    argument kv_cache_memory_bytes carries engine.kv_cache_gb as it is."""
    from rollout_service.engine.vllm_engine import VllmEngine

    monkeypatch.setattr("rollout_service.engine.vllm_engine.is_cpu_platform", lambda: True)
    for gb, size in ((0.25, 2**28), (2.0, 2 * 2**30), (1.5, 3 * 2**29)):
        engine = load_config(**{"engine.kv_cache_gb": gb}).engine
        assert VllmEngine("e", "m", engine).engine_args().kv_cache_memory_bytes == size


def test_k_control_auto_is_the_default_and_uses_the_controlled_scheduler():
    from rollout_service.config import OPEN_BATCH, k_mode
    from rollout_service.engine.vllm_engine import K_SCHEDULER, VllmEngine, speculative_config

    cfg = load_config(**{"engine.speculation.method": "ngram"})
    sp = cfg.engine.speculation
    assert k_mode(sp) == "auto"
    # vLLM's dynamic-k path is on (no padding to a fixed k); the controller replaces its lookup
    assert speculative_config(sp)["num_speculative_tokens_per_batch_size"] == [[1, OPEN_BATCH, 3]]
    assert VllmEngine("e", "m", cfg.engine).engine_args().scheduler_cls == K_SCHEDULER
    fixed = load_config(**{"engine.speculation.method": "ngram", "engine.speculation.k_control": "fixed"}).engine
    assert VllmEngine("e", "m", fixed).engine_args().scheduler_cls is None
    assert k_mode(load_config().engine.speculation) == "none"
    assert k_mode(load_config(**{"engine.speculation.method": "ngram",
                                 "engine.speculation.k_by_batch_size": [(1, 4, 3)]}).engine.speculation) == "schedule"
    with pytest.raises(ConfigError, match="k_control must be one of auto, fixed"):
        load_config(**{"engine.speculation.method": "ngram", "engine.speculation.k_control": "smart"})


def test_k_schedule_flag_syntax():
    from rollout_service.config import OPEN_BATCH, parse_k_schedule

    assert parse_k_schedule("1-4:3, 5-16:1,17-:0") == [(1, 4, 3), (5, 16, 1), (17, OPEN_BATCH, 0)]
    for bad in ("1:3", "1-4", "a-4:3", "1-4:-1"):
        with pytest.raises(ConfigError, match="FIRST-LAST:K"):
            parse_k_schedule(bad)


@pytest.mark.parametrize("schedule,needle", [
    ([(2, 8, 3)], "must start at batch size 1"),
    ([(1, 8, 3), (5, 16, 1)], "sorted and must not overlap"),
    ([(1, 8, 4)], "k must be in [0, num_speculative_tokens=3]"),
    ([(1, 8, 3), (9, 4, 1)], "1 <= first <= last"),
])
def test_bad_k_schedule_is_refused_with_the_range(schedule, needle):
    with pytest.raises(ConfigError) as e:
        load_config(**{"engine.speculation.method": "ngram", "engine.speculation.k_by_batch_size": schedule})
    assert needle in str(e.value)
    with pytest.raises(ConfigError, match="needs a speculation method"):
        load_config(**{"engine.speculation.k_by_batch_size": [(1, 8, 3)]})


def test_serve_rejects_a_malformed_k_schedule_flag():
    r = subprocess.run([sys.executable, "-m", "rollout_service.cli", "serve", "--speculation", "ngram",
                        "--k-by-batch-size", "1-8=3"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "1-8=3" in r.stderr and "FIRST-LAST:K" in r.stderr


def test_weights_roots_must_be_absolute_and_the_flag_repeats():
    from rollout_service.cli import build_parser

    with pytest.raises(ConfigError, match="security.weights_roots"):
        load_config(**{"security.weights_roots": ["relative/dir"]})
    args = build_parser().parse_args(["serve", "--weights-root", "/a", "--weights-root", "/b"])
    assert load_config(**{"security.weights_roots": args.weights_root}).security.weights_roots == ["/a", "/b"]
    assert load_config().security.weights_roots == []        # the cache directory (server.app.weights_roots)


def test_the_docs_table_is_generated_from_the_schema():
    """docs/configuration.md holds config_table() between its markers: regenerate it with
    `python -m rollout_service.config` when a field changes."""
    from pathlib import Path

    from rollout_service.config import config_table

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    inside = doc.split("-->\n", 1)[1].split("<!-- /config-table -->", 1)[0]
    assert inside == config_table(), "docs/configuration.md's table is stale: python -m rollout_service.config"


def test_every_field_with_a_flag_is_a_serve_flag_and_limits_name_the_field():
    from rollout_service.cli import SERVE_FLAGS, build_parser
    from rollout_service.config import fields

    build_parser()
    assert sorted(SERVE_FLAGS.values()) == sorted(f.path for f in fields() if f.flag)
    for overrides, message in [({"engines": 0}, "engines must be >= 1"),
                               ({"grpc_port": 70000}, "grpc_port must be in [0, 65535]"),
                               ({"engine.kv_cache_gb": 0}, "engine.kv_cache_gb must be > 0"),
                               ({"engine.dtype": "int8"},
                                "engine.dtype must be one of auto, bfloat16, float16, float32"),
                               ({"engine.speculation.num_speculative_tokens": 17},
                                "engine.speculation.num_speculative_tokens must be in [1, 16]")]:
        with pytest.raises(ConfigError) as e:
            load_config(**overrides)
        assert str(e.value) == message
