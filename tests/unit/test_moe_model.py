"""The MoE policy (rollout_service/moe_model.py): SmolLM2 sparsely upcycled into a Mixtral. Without noise the
upcycled model is the dense one; saved, it is a Mixtral checkpoint in the per-expert format vLLM loads; with the
default noise it stays close to SmolLM2 while the experts it routes to matter (transformers only, no vLLM)."""
import json

import pytest
import torch
from safetensors import safe_open

from rollout_service import models, moe_model
from rollout_service.model_info import MoeShape


def tiny_dense(seed=0, tied=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=256, tie_word_embeddings=tied)).float().eval()


def logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logits.logsumexp(-1)


@pytest.mark.parametrize("tied", [True, False])
def test_upcycling_without_noise_is_the_dense_model(tied):
    dense = tiny_dense(tied=tied)
    moe = moe_model.upcycle(dense, experts=4, top_k=2, noise=0.0)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert torch.allclose(logprobs(moe, ids), logprobs(dense, ids), atol=1e-5)
    noisy = moe_model.upcycle(dense, experts=4, top_k=2)
    assert not torch.allclose(logprobs(noisy, ids), logprobs(dense, ids), atol=1e-5)


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match="top_k"):
        moe_model.upcycle(tiny_dense(), experts=2, top_k=3)


def test_prepared_checkpoint_is_a_mixtral_vllm_loads(tmp_path, monkeypatch):
    """prepare_moe_model on a tiny dense model standing in for SmolLM2: cached under cache_dir(), the checkpoint in
    Mixtral's per-expert names, an MoE config, reloaded to the same function."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tok_models

    base = tmp_path / "dense"
    tiny_dense().save_pretrained(base)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel({"t0": 0}, unk_token="t0"))
                            ).save_pretrained(base)
    monkeypatch.setenv("ROLLOUT_SERVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(moe_model, "prepare_default_model", lambda: base)
    out = moe_model.prepare_moe_model(experts=4, top_k=2)
    assert out == moe_model.moe_model_dir(4, 2) and out.is_relative_to(models.cache_dir())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert MoeShape.of(config) == MoeShape(num_experts=4, top_k=2, num_layers=3)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.2.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)
    stamp = (out / "config.json").stat().st_mtime_ns
    assert moe_model.prepare_moe_model() == out and (out / "config.json").stat().st_mtime_ns == stamp   # cached
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert (logprobs(reloaded, ids) - logprobs(dense, ids)).abs().mean() < 0.1


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        path = models.prepare_default_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def test_upcycled_smollm2_stays_close_to_smollm2_and_routing_matters(smollm2):
    """Per-token log-probs of chat prompts with answers, upcycled (4 experts, top-2, default noise) against SmolLM2;
    and the same upcycled model with every token sent to the two experts its router did not pick."""
    from rollout_tasks.arithmetic import split
    from rollout_tasks.chat import chat_token_ids, user_turn
    from trainer_example import routing_replay

    dense, tok = smollm2
    torch.set_num_threads(2)
    moe = moe_model.upcycle(dense)
    assert MoeShape.of(moe.config.to_dict()) == MoeShape(num_experts=4, top_k=2, num_layers=30)
    seqs = [chat_token_ids(tok, user_turn(p.prompt)) + tok(f" Answer: {p.answer}", add_special_tokens=False)[
        "input_ids"] for p in split(3, start=123)]
    width = min(len(s) for s in seqs)
    ids = torch.tensor([s[:width] for s in seqs])
    ref, got = logprobs(dense, ids), logprobs(moe, ids)
    gap = (got - ref).abs()
    assert gap.mean() < 0.2 and gap.max() < 2.0, (float(gap.mean()), float(gap.max()))
    routes = torch.zeros(*ids.shape, 30, 2, dtype=torch.long)

    def keep(i):
        def hook(module, args, out):
            routes[:, :, i] = out[2].view(*ids.shape, 2)
        return hook

    hooks = [r.register_forward_hook(keep(i)) for i, r in routing_replay.moe_routers(moe).items()]
    logprobs(moe, ids)
    for h in hooks:
        h.remove()
    taken = torch.zeros(*routes.shape[:-1], 4, dtype=torch.bool).scatter_(-1, routes, True)
    other = (~taken).nonzero()[:, -1].view(routes.shape)            # the two experts the router did not pick
    with routing_replay.replay(moe, other, torch.ones(ids.shape, dtype=torch.bool)):
        moved = (logprobs(moe, ids) - got).abs().mean()
    assert moved > 0.02, float(moved)


def test_the_name_moe_resolves_to_the_prepared_policy(tmp_path, monkeypatch, capsys):
    from rollout_service import cli

    calls = []
    monkeypatch.setattr(moe_model, "prepare_moe_model", lambda **kw: calls.append(kw) or tmp_path)
    monkeypatch.chdir(tmp_path)                       # no directory named `moe` here
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")     # main() sets it; restored after the test
    assert cli.resolve_model("moe") == str(tmp_path) and calls == [{}]
    assert cli.main(["prepare-model", "--moe", "--experts", "8", "--top-k", "1"]) == 0
    assert calls[-1] == {"force": False, "experts": 8, "top_k": 1} and capsys.readouterr().out.strip() == str(tmp_path)
    with pytest.raises(SystemExit, match="not a Hugging Face model directory"):
        cli.resolve_model(str(tmp_path / "missing"))
