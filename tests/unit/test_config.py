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
