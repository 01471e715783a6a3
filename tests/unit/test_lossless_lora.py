"""verify-lossless with a LoRA adapter (--adapter, --lora-rank): the flags' errors before any engine, the adapter and
its power check reaching check_lossless and the exit status, the random adapter's size, and the log-prob reference
being the base with the adapter merged. The check itself on real engines: tests/integration/test_speculation.py
test_lora_speculation_is_lossless_by_the_verify_lossless_command."""
import json
from types import SimpleNamespace

import pytest
import torch

from rollout_service import cli
from rollout_service.drafting import lossless


def run(argv, monkeypatch, tmp_path, power_rejected=True):
    seen = {}
    monkeypatch.setattr(cli, "resolve_model", lambda m: str(tmp_path))
    monkeypatch.setattr("rollout_service.model_info.ModelInfo.load", lambda m, n: SimpleNamespace(
        vocab_size=100, encode=lambda p, chat: [1, 2, 3]))
    monkeypatch.setattr("rollout_service.engine.forkserver.prestart", lambda *a: None)
    monkeypatch.setattr(lossless, "random_adapter", lambda model, r, out, relative: seen.update(
        rank=r, scale=relative) or out)

    def check(model, spec, prompts, **kw):
        seen.update(kw)
        return SimpleNamespace(render=lambda: "", passed=True, engine_failed="", power=None,
                               power_adapter=SimpleNamespace(passed_distribution=not power_rejected))

    monkeypatch.setattr(lossless, "check_lossless", check)
    return cli.cmd_verify_lossless(cli.build_parser().parse_args(["verify-lossless", "--method", "ngram", *argv])), seen


def test_adapter_flags_are_checked_before_any_engine(monkeypatch, tmp_path, capsys):
    assert run(["--lora-rank", "0"], monkeypatch, tmp_path)[0] == 2
    assert "--lora-rank 0: must be 1 to 256" in capsys.readouterr().err
    assert run(["--lora-rank", "8", "--lora-scale", "0"], monkeypatch, tmp_path)[0] == 2
    assert "--lora-scale 0.0: must be > 0" in capsys.readouterr().err
    assert run(["--lora-rank", "8", "--quantization", "int8"], monkeypatch, tmp_path)[0] == 2
    assert "--quantization int8: not with a LoRA adapter" in capsys.readouterr().err
    assert run(["--adapter", str(tmp_path / "none")], monkeypatch, tmp_path)[0] == 2
    assert "--adapter" in (err := capsys.readouterr().err) and "adapter_config.json" in err
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"r": 512}))
    assert run(["--adapter", str(tmp_path / "big")], monkeypatch, tmp_path)[0] == 2
    assert "rank 512 is above the largest" in capsys.readouterr().err
    with pytest.raises(SystemExit):                       # one or the other
        cli.build_parser().parse_args(["verify-lossless", "--adapter", "x", "--lora-rank", "8"])


def test_the_adapter_reaches_the_check_and_its_power_decides_the_exit(monkeypatch, tmp_path, capsys):
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"r": 12}))
    assert lossless.lora_rank_for(str(tmp_path / "ad")) == 16
    rc, seen = run(["--adapter", str(tmp_path / "ad")], monkeypatch, tmp_path)
    assert rc == 0 and seen["adapter"] == str(tmp_path / "ad")
    rc, seen = run(["--lora-rank", "4", "--lora-scale", "2.5"], monkeypatch, tmp_path)
    assert rc == 0 and (seen["rank"], seen["scale"]) == (4, 2.5) and seen["adapter"]    # random, in a scratch dir
    rc, _ = run(["--lora-rank", "4"], monkeypatch, tmp_path, power_rejected=False)
    assert rc == 1 and "POWER NOT SHOWN: the samples without the adapter" in capsys.readouterr().out
    rc, seen = run([], monkeypatch, tmp_path, power_rejected=False)  # no adapter: no adapter power to show
    assert rc == 0 and seen["adapter"] == ""


def test_a_random_adapter_moves_every_linear_layer_and_the_reference_merges_it(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", layers=1, hidden=64)
    out = lossless.random_adapter(str(model), 4, str(tmp_path / "adapter"), relative=0.3)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), out)
    layers = [m for m in peft.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(layers) == 7                               # q k v o gate up down of the one decoder layer
    for m in layers:
        delta = m.scaling["default"] * (m.lora_B["default"].weight @ m.lora_A["default"].weight)
        assert delta.norm() / m.base_layer.weight.norm() == pytest.approx(0.3, rel=1e-4)
    # the reference: log-probs the base would give are off by the adapter's change, the merged model's are exact
    from rollout_service.drafting.reference import processed_logprobs

    merged = peft.merge_and_unload().eval()
    prompt, gen = [1, 5, 9], [3, 4, 7, 8]
    on_adapter = processed_logprobs(merged, prompt, gen, 1.0, 0, 1.0)
    out_seq = [(0, SimpleNamespace(token_ids=gen, logprobs=on_adapter.numpy()))]
    assert lossless._logprob_error(str(model), [prompt], out_seq, 1.0, 0, 1.0, adapter=out) < 1e-5
    assert lossless._logprob_error(str(model), [prompt], out_seq, 1.0, 0, 1.0) > 1e-3
    assert not torch.equal(base.model.layers[0].self_attn.q_proj.weight, merged.model.layers[0].self_attn.q_proj.weight)
