"""engine/quantize.py (the int8 served precision: what a commit does to pushed float weights), the manifest of a
quantized target, start-up refusals, and the reference int8 forward pass the integration tests compare with."""
import json

import pytest
import torch

from rollout_service.config import ConfigError, EngineConfig, load_config
from rollout_service.drafting.reference import _Int8Linear, int8_w8a8
from rollout_service.engine import quantize
from rollout_service.weights.manifest import Manifest, TensorSpec


def test_int8_weights_one_symmetric_scale_per_output_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=g) * torch.tensor([0.01, 0.1, 1, 10, 100, 0])[:, None]
    q, scale = quantize.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (6, 1)
    torch.testing.assert_close(scale[:5, 0], w[:5].abs().amax(1) / 127)
    assert q.abs().max() == 127 and torch.all(q[5] == 0) and scale[5, 0] > 0          # an all-zero row stays zero
    assert torch.all((q.float() * scale - w).abs() <= scale / 2 + 1e-6)              # round to nearest
    qb, sb = quantize.quantize_int8(w.to(torch.bfloat16))                              # bf16 in: scales in float32
    assert sb.dtype == torch.float32 and (qb.int() - q.int()).abs().max() <= 1


def test_quantized_items_quantize_the_named_and_cast_the_rest():
    w, emb = torch.randn(4, 8), torch.randn(10, 8, dtype=torch.bfloat16)
    out = dict(quantize.quantized_items([("l.weight", w), ("embed.weight", emb), ("ids", torch.arange(3))],
                                        frozenset({"l.weight"}), torch.float32))
    assert set(out) == {"l.weight", "l.weight_scale", "embed.weight", "ids"}
    assert out["l.weight"].dtype == torch.int8 and out["embed.weight"].dtype == torch.float32
    assert out["ids"].dtype == torch.int64
    with pytest.raises(ValueError, match="l.weight.*float"):
        list(quantize.quantized_items([("l.weight", w.to(torch.int8))], frozenset({"l.weight"}), torch.float32))


def test_which_checkpoint_tensors_int8_quantizes():
    assert quantize.quantizes("model.layers.0.self_attn.q_proj.weight", 2)
    assert quantize.quantizes("model.layers.3.mlp.down_proj.weight", 2)
    for name, ndim in (("model.embed_tokens.weight", 2), ("lm_head.weight", 2), ("model.norm.weight", 1),
                       ("model.layers.0.input_layernorm.weight", 1), ("model.layers.0.self_attn.q_proj.bias", 1)):
        assert not quantize.quantizes(name, ndim), name


def test_the_int8_checkpoint_holds_scales_beside_each_linear_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "float"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True}))
    (src / "tokenizer.json").write_text("{}")
    w = torch.randn(8, 4)
    save_file({"model.layers.0.mlp.up_proj.weight": w, "model.embed_tokens.weight": torch.randn(16, 4),
               "model.norm.weight": torch.ones(4)}, str(src / "model.safetensors"))
    out = quantize.write_checkpoint(src, tmp_path / "int8")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["ignore"] == ["lm_head"] and (out / "tokenizer.json").is_file()
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    q, scale = quantize.quantize_int8(w)
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], q)
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight_scale"], scale)
    assert got["model.embed_tokens.weight"].dtype == torch.float32 and "model.norm.weight_scale" not in got
    assert quantize.quantized_names_of(out) == {"model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="already quantized"):
        quantize.write_checkpoint(out, tmp_path / "again")


def test_a_quantized_target_takes_any_float_dtype():
    tensors = {"w": TensorSpec("float32", (2, 2)), "ids": TensorSpec("int64", (2,))}
    plain = Manifest(tensors, frozenset(), "float32")
    assert plain.allowed_dtypes("w") == {"float32"}
    q = Manifest(tensors, frozenset(), "float32", quantized=True)
    assert q.allowed_dtypes("w") == {"float32", "bfloat16", "float16"}
    assert q.allowed_dtypes("ids") == plain.allowed_dtypes("ids")                   # not a float: as before
    assert q.check_tensor("w", "bfloat16", (2, 2))


def test_status_says_what_is_served():
    d = quantize.describe("int8", "float32", "none", False)
    assert d["method"] == "int8" and d["scheme"] == "compressed-tensors w8a8" and d["dtype"] == "float32"
    assert "per output channel" in d["weights"] and "per token" in d["activations"]
    assert quantize.describe("none", "bfloat16")["scheme"] == ""


def test_config_and_start_up_refusals_name_the_flag(monkeypatch):
    assert load_config(**{"engine.quantization": "int8"}).engine.quantization == "int8"
    with pytest.raises(ConfigError, match="engine.quantization must be one of none, int8, fp8, mxfp8"):
        load_config(**{"engine.quantization": "int4"})
    with pytest.raises(ConfigError, match="--draft-quantization.*draft_model"):
        load_config(**{"engine.speculation.quantization": "int8"})
    pytest.importorskip("vllm")
    from rollout_service.engine import vllm_engine

    monkeypatch.setattr(vllm_engine, "is_cpu_platform", lambda: True)
    for cfg, needle in ((EngineConfig(quantization="fp8"), r"engine.quantization \(--quantization\) fp8 needs GPU"),
                        (EngineConfig(quantization="mxfp8"), "mxfp8 needs GPU nodes"),
                        (EngineConfig(batch_invariant=True), r"--batch-invariant\) needs GPU nodes.*Triton")):
        with pytest.raises(ConfigError, match=needle):
            vllm_engine.check_supported(cfg, moe=False)
    with pytest.raises(ConfigError, match="int8 serves dense policies only"):
        vllm_engine.check_supported(EngineConfig(quantization="int8"), moe=True)
    vllm_engine.check_supported(EngineConfig(quantization="int8"), moe=False)
    with pytest.raises(ConfigError, match="attention head size is 24 .*supports 32, 64"):
        vllm_engine.check_supported(EngineConfig(), moe=False, head_size=24)
    vllm_engine.check_supported(EngineConfig(), moe=False, head_size=64)
    monkeypatch.setattr(vllm_engine, "is_cpu_platform", lambda: False)                # GPU nodes: passed to vLLM
    vllm_engine.check_supported(EngineConfig(quantization="fp8", batch_invariant=True), moe=False, head_size=24)


def test_a_model_shorter_than_the_configured_context_is_served_at_its_own():
    """--max-model-len 2048 (the default) on a 1024-token model: vLLM refused it with a pydantic traceback; the service
    serves 1024 and says so. The head size comes from head_dim, else hidden_size / num_attention_heads."""
    from rollout_service.config import ServerConfig
    from rollout_service.model_info import ModelInfo, head_size_of
    from rollout_service.server.app import fit_context

    cfg = ServerConfig()
    said = fit_context(cfg, ModelInfo(path="m", vocab_size=10, max_model_len=1024, tokenizer=None))
    assert cfg.engine.max_model_len == 1024 and "--max-model-len) 2048 is above the model's context, 1024" in said
    assert fit_context(cfg, ModelInfo(path="m", vocab_size=10, max_model_len=4096, tokenizer=None)) is None
    assert head_size_of({"hidden_size": 96, "num_attention_heads": 4}) == 24
    assert head_size_of({"hidden_size": 576, "num_attention_heads": 9, "head_dim": 64}) == 64


def test_the_reference_int8_layer_models_the_cpus_int16_pair_saturation():
    """Without saturation the reference is exact integer W8A8; with it, each adjacent pair of u8 x s8 products is
    clipped to int16 (vpmaddubsw): a row with large activations on large weights differs, a small one does not."""
    lin = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 1.0, 0.5, 0.0], [0.01, -0.01, 0.02, 1.0]]))
    x = torch.tensor([[1.0, 1.0, 0.0, -1.0]])          # u8 = x_q + 128: 255, 255 on weights 127, 127: 64770 > 32767
    exact, sat = _Int8Linear(lin, saturate=False)(x), _Int8Linear(lin, saturate=True)(x)
    torch.testing.assert_close(exact, lin(x), atol=0.02, rtol=0.02)
    assert sat[0, 0] < exact[0, 0] - 0.5 and torch.allclose(sat[0, 1], exact[0, 1])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    int8_w8a8(model, saturate=False)
    assert isinstance(model[0], _Int8Linear)


class OneHotLinear(torch.nn.Module):
    """A "model" whose logits come from one linear layer over one-hot inputs (every activation on the int8 grid)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)
        torch.nn.init.normal_(self.proj.weight, std=3.0)

    def forward(self, ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.proj(torch.nn.functional.one_hot(ids, 8).float()))


def test_verify_lossless_checks_against_the_served_precision(monkeypatch, tmp_path):
    """`verify-lossless --quantization int8` serves int8 on both engines and compares the log-probs with the int8
    forward pass (drafting/reference.py int8_w8a8), at the int8 tolerance; a bad precision flag fails before any
    model is read."""
    import copy
    from types import SimpleNamespace

    from rollout_service import cli
    from rollout_service.drafting import lossless
    from rollout_service.drafting.reference import processed_logprobs

    args = cli.build_parser().parse_args(["verify-lossless", "--method", "ngram", "--quantization", "int8"])
    assert (args.quantization, args.draft_quantization) == ("int8", "none")
    bad = cli.build_parser().parse_args(["verify-lossless", "--method", "ngram", "--draft-quantization", "int8"])
    assert cli.cmd_verify_lossless(bad) == 2                 # a drafter precision needs draft_model
    seen = {}
    monkeypatch.setattr(cli, "resolve_model", lambda m: str(tmp_path))
    monkeypatch.setattr("rollout_service.model_info.ModelInfo.load", lambda m, n: SimpleNamespace(
        encode=lambda p, chat: [1, 2, 3]))
    monkeypatch.setattr(lossless, "check_lossless", lambda model, spec, prompts, **kw: seen.update(kw) or
                        SimpleNamespace(render=lambda: "", passed=True, engine_failed="", power=None))
    assert cli.cmd_verify_lossless(args) == 0
    assert seen["base"].quantization == "int8" and seen["base"].dtype == "float32" and seen["logprob_samples"] == 6
    assert lossless.LOGPROB_ATOL["int8"] > lossless.LOGPROB_ATOL["none"]

    float_model = OneHotLinear().eval()
    served = processed_logprobs(int8_w8a8(copy.deepcopy(float_model), saturate=False), [1, 2], [3, 4, 5], 1.0, 0, 1.0)
    out = [(0, SimpleNamespace(token_ids=[3, 4, 5], logprobs=served.numpy()))]     # what an int8 engine returned
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: copy.deepcopy(float_model))
    monkeypatch.setattr("rollout_service.drafting.reference.int16_pair_saturation", lambda: False)
    assert lossless._logprob_error("m", [[1, 2]], out, 1.0, 0, 1.0, "int8") < 1e-6
    assert lossless._logprob_error("m", [[1, 2]], out, 1.0, 0, 1.0, "none") > 1e-4
    # one-hot inputs lie on the int8 grid: float rounding cannot move them, the tolerance stays LOGPROB_ATOL's
    assert lossless._int8_spread("m", [[1, 2]], out, 1.0, 0, 1.0) == 0.0


def test_verify_lossless_takes_token_id_prompts_lookup_bounds_and_a_power_temperature(monkeypatch, tmp_path, capsys):
    """--prompt-ids (n-gram prompts that repeat what the drafter should match), --prompt-lookup-min/max and
    --power-temperature reach check_lossless; the command exits 1 when the mismatched samples are not rejected (no
    power shown), 0 when they are; bad ids or a temperature <= 0: exit 2 naming the flag, before any engine."""
    from types import SimpleNamespace

    from rollout_service import cli
    from rollout_service.drafting import lossless

    seen = {}
    monkeypatch.setattr(cli, "resolve_model", lambda m: str(tmp_path))
    monkeypatch.setattr("rollout_service.model_info.ModelInfo.load", lambda m, n: SimpleNamespace(
        vocab_size=100, encode=lambda p, chat: [1, 2, 3]))
    rejected = [True]

    def check(model, spec, prompts, **kw):
        seen.update(kw, spec=spec, prompts=prompts)
        return SimpleNamespace(render=lambda: "", passed=True, engine_failed="",
                               power=None if kw["power_temperature"] is None
                               else SimpleNamespace(passed_distribution=not rejected[0]))

    monkeypatch.setattr(lossless, "check_lossless", check)
    argv = ["verify-lossless", "--method", "ngram", "--quantization", "int8", "--prompt-lookup-min", "1",
            "--prompt-lookup-max", "3", "--prompt-ids", "1,5,6,5", "1, 7,8", "--power-temperature", "0.6"]
    assert cli.cmd_verify_lossless(cli.build_parser().parse_args(argv)) == 0
    assert seen["prompts"] == [[1, 5, 6, 5], [1, 7, 8]] and seen["power_temperature"] == 0.6
    assert (seen["spec"].method, seen["spec"].prompt_lookup_min, seen["spec"].prompt_lookup_max) == ("ngram", 1, 3)
    assert seen["base"].quantization == "int8"
    rejected[0] = False
    assert cli.cmd_verify_lossless(cli.build_parser().parse_args(argv)) == 1
    assert "POWER NOT SHOWN" in capsys.readouterr().out
    seen.clear()
    for bad, names in ((["--prompt-ids", "1,x"], "not a comma-separated list"), (["--prompt-ids", "1,100"], "[100]"),
                       (["--prompt-ids", ","], "empty"), (["--power-temperature", "0"], "must be > 0"),
                       (["--prompt-lookup-min", "4", "--prompt-lookup-max", "3"], "prompt_lookup_min")):
        assert cli.cmd_verify_lossless(cli.build_parser().parse_args(argv + bad)) == 2, bad
        err = capsys.readouterr().err
        assert names in err and ("--p" in err or "prompt_lookup" in err), err
    assert not seen                                           # nothing sampled
    seen.clear()
    assert cli.cmd_verify_lossless(cli.build_parser().parse_args(["verify-lossless", "--method", "ngram"])) == 0
    assert seen["prompts"] == [[1, 2, 3], [1, 2, 3]] and seen["power_temperature"] is None   # the default prompts


def test_the_fast_saturating_product_equals_the_pair_by_pair_one():
    """_Int8Linear sums exactly and corrects only the weight pairs that can leave int16 (|w0| + |w1| >= 129): the same
    integers as summing every pair of products with the clip (odd widths, large weights and activations included)."""
    torch.manual_seed(0)
    for out_features, in_features in ((16, 33), (48, 96)):
        lin = torch.nn.Linear(in_features, out_features)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_features, in_features) * torch.rand(out_features, 1) ** 3)
            lin.weight[:, :4] *= 50                              # some rows' largest weights side by side
        xq = torch.randint(-127, 128, (24, in_features))
        xq[:, :4] = 127
        for saturate in (False, True):
            layer = _Int8Linear(lin, saturate=saturate)
            assert torch.equal(layer._int_product(xq), layer._int_product_every_pair(xq))
        assert not torch.equal(layer._int_product(xq), xq @ layer.w.t())        # some pairs did clip


def test_an_activation_an_ulp_from_an_int8_rounding_boundary_moves_the_layer_by_a_whole_step():
    """Per-token int8 activation scales make the int8 forward pass discontinuous: an input a float32 rounding (an ulp,
    as other float kernels around the layer give) from a rounding boundary rounds the other way and the output
    moves by a quantization step; inputs away from boundaries do not move (drafting/reference.py `rounding`)."""
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.0, 1.0]]))
    edge = torch.tensor([[1.0, 10.5 / 127]])          # x * 127 / absmax = 10.5 (to float32): rounds to 10 or 11
    inside = torch.tensor([[1.0, 10.2 / 127]])
    base = _Int8Linear(lin, saturate=False)
    outs = {round(float(_Int8Linear(lin, False, torch.Generator().manual_seed(s))(edge)) * 127) for s in range(8)}
    assert outs == {10, 11} and round(float(base(edge)) * 127) in outs                  # one step = 1/127 apart
    assert {float(_Int8Linear(lin, False, torch.Generator().manual_seed(s))(inside)) for s in range(8)} \
        == {float(base(inside))}


def test_depth_amplifies_int8_rounding_into_log_prob_differences():
    """int8_rounding_spread: a one-hot "model" (every activation exactly on the int8 grid) is fixed by the int8
    arithmetic alone (spread 0); a 24-layer residual stack moves its log-probs visibly under one-ulp input changes."""
    from types import SimpleNamespace

    from rollout_service.drafting.reference import int8_rounding_spread

    class Deep(torch.nn.Module):
        def __init__(self, layers: int, width: int = 64, vocab: int = 32):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, width)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
            self.head = torch.nn.Embedding(vocab, width)                   # not a Linear: stays float
            for lin in self.layers:
                torch.nn.init.normal_(lin.weight, std=1.5 / width ** 0.5)

        def forward(self, ids):
            h = self.emb(ids)
            for lin in self.layers:
                h = h + lin(torch.nn.functional.rms_norm(h, (h.shape[-1],)))
            return SimpleNamespace(logits=4 * torch.nn.functional.rms_norm(h, (h.shape[-1],)) @ self.head.weight.t())

    torch.manual_seed(0)
    seqs = [([1, 2, 3], [4, 5, 6, 7]), ([3, 1], [0, 2, 6])]
    assert int8_rounding_spread(OneHotLinear().eval(), [(p[:1], p[1:] + g) for p, g in seqs], 1.0, 0, 1.0).max() == 0
    # The stack mixes no positions: each distinct token id is one computation, and a flip (an activation within an
    # ulp of an int8 rounding boundary) is a matter of chance per computation. With ~1,000 ids every one of 20 model
    # seeds flipped (0.15-1.1 nats); with 32 ids, 2 of 8 did (the rest 3e-5, on an AVX-512 VNNI CPU)
    deep = Deep(24, vocab=1024).eval()
    seqs = [(list(torch.randint(0, 1024, (128,))), list(torch.randint(0, 1024, (128,)))) for _ in range(8)]
    spread = int8_rounding_spread(deep, [([int(t) for t in p], [int(t) for t in g]) for p, g in seqs], 1.0, 0, 1.0)
    assert spread.max() > 1e-3
