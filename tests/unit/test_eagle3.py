"""EAGLE-3 head: the vLLM checkpoint format round-trips, and the training batches line up draft steps with
the tokens and target distributions vLLM will use (vLLM itself runs the head in
tests/integration/test_speculation.py::test_eagle3_speculation_is_lossless)."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout_service.drafting import eagle3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("target")
    model.save_pretrained(out)
    return model, out


def test_aux_layers_follow_vllm_default_and_fit_shallow_models():
    assert eagle3.default_aux_layers(30) == [2, 15, 27]
    assert eagle3.default_aux_layers(2) == [0, 1]


def test_saved_head_is_in_vllm_format_and_loads_back(target, tmp_path):
    model, target_dir = target
    vocab = [0, 5, 7, 100, 299]
    aux = eagle3.default_aux_layers(8)
    head = eagle3.make_head(model.config, vocab, model.get_input_embeddings().weight, aux)
    eagle3.save_head(head, str(target_dir), tmp_path / "head", aux, {"note": "test"})
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 5
    assert cfg["eagle_aux_hidden_state_layer_ids"] == aux and cfg["architectures"] == ["LlamaForCausalLM"]
    sd = head.vllm_state_dict()
    assert sd["fc.weight"].shape == (64, 3 * 64)
    assert sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64         # q/k/v read [embeds, hidden]
    assert (torch.arange(5) + sd["d2t"]).tolist() == vocab                   # vLLM: target = draft + d2t
    loaded = eagle3.load_head(tmp_path / "head", model)
    for name, value in loaded.vllm_state_dict().items():
        torch.testing.assert_close(value, sd[name], rtol=0, atol=0)
    full = eagle3.make_head(model.config, list(range(300)), model.get_input_embeddings().weight, aux)
    assert "d2t" not in full.vllm_state_dict()                               # full vocabulary: no mapping


def test_batches_pair_each_draft_step_with_its_token_and_target_distribution():
    """Anchor t (a position of the target's features) drafts step s from token t+s and is scored against
    the target's distribution at position t+s."""
    L, A, first, steps = 10, 6, 3, 3
    ids = torch.arange(100, 100 + L)
    top_i = torch.zeros(L, eagle3.TOPK, dtype=torch.long)
    top_i[:, 0] = torch.arange(L)               # position j's most likely token is j (a draft id marker)
    top_p = torch.zeros(L, eagle3.TOPK)
    top_p[:, 0] = 1.0
    aux = torch.arange(L, dtype=torch.float32)[:, None].expand(L, A)
    feats = [(aux, ids, top_i, top_p, first)]
    to_draft = torch.arange(300)
    a, nxt, ti, tp = eagle3._batch(feats, [0], steps, to_draft)
    n = L - 1 - first                            # anchors first .. L-2
    assert a.shape[1] == n and a[0, :, 0].tolist() == list(range(first, L - 1))
    for s in range(1, steps + 1):
        for j in range(n):
            t = first + j
            if t + s <= L - 1:
                assert nxt[0, j + s - 1] == ids[t + s]
                assert ti[s - 1, 0, j, 0] == t + s and tp[s - 1, 0, j, 0] == 1.0
            else:
                assert tp[s - 1, 0, j].sum() == 0     # beyond the sample: not scored
