"""Routing replay (trainer_example/routing_replay.py) on tiny random MoE models, Mixtral and Qwen3-MoE (no service):
a batch replayed with the routes its own routers chose gives exactly the unforced log-probs; other routes change them
and are counted as differing decisions; gradients still reach every router; and the trainer's step on an MoE policy
trains on replayed forward passes and logs the mismatch both ways."""
import numpy as np
import pytest
import torch

from trainer_example import routing_replay
from trainer_example.grpo import token_logprobs

VOCAB = 96


def tiny_moe(kind: str, norm_topk_prob: bool = True, seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4))
    else:       # layer 1 dense (mlp_only_layers): the routes' layer axis counts every decoder layer
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=6, head_dim=8,
                                                   norm_topk_prob=norm_topk_prob, mlp_only_layers=[1]))
    with torch.no_grad():
        for router in routing_replay.moe_routers(model).values():
            router.weight.normal_(0, 1.0)          # decisive routing: top-k margins far above float noise
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0, 0.3)                  # experts that differ enough to move the next-token log-probs
    return model.float().eval()


def padded_batch(seed: int = 1):
    """Right-padded ids [3, L] of different lengths and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 7, 9]
    ids = torch.zeros(3, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask, lengths


def own_routes(model, ids, mask):
    """The routes the model's own routers choose on [B, L]: int64 [B, L, layers, top_k] (zeros at dense layers)."""
    routers = routing_replay.moe_routers(model)
    layers, k = len(model.model.layers), next(iter(routers.values())).top_k
    b, length = ids.shape
    routes = torch.zeros(b, length, layers, k, dtype=torch.long)

    def keep(i):
        def hook(module, args, out):            # returns None: the router's output is left as it is
            routes[:, :, i] = out[2].view(b, length, k)
        return hook

    hooks = [r.register_forward_hook(keep(i)) for i, r in routers.items()]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    return routes


def disjoint(routes, num_experts):
    """For each [.., top_k] route, the top_k lowest experts it does not name (needs num_experts >= 2 top_k)."""
    k = routes.shape[-1]
    taken = torch.zeros(*routes.shape[:-1], num_experts, dtype=torch.bool).scatter_(-1, routes, True)
    order = torch.arange(num_experts).expand_as(taken) + taken * num_experts      # free experts sort first
    return order.argsort(-1)[..., :k]


def routed_rows(lengths, width):
    """Every row but each sample's last token and the padding."""
    routed = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        routed[i, :n - 1] = True
    return routed


def logprobs(model, ids, mask):
    return token_logprobs(model(input_ids=ids, attention_mask=mask).logits[:, :-1], ids[:, 1:])


MODELS = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize("kind,norm", MODELS)
def test_own_routes_reproduce_the_unforced_forward_exactly(kind, norm):
    model = tiny_moe(kind, norm)
    ids, mask, lengths = padded_batch()
    routes = own_routes(model, ids, mask)
    with torch.no_grad():
        free = logprobs(model, ids, mask)
        stats = routing_replay.RouteStats()
        with routing_replay.replay(model, routes, routed_rows(lengths, ids.shape[1]), stats):
            replayed = logprobs(model, ids, mask)
        after = logprobs(model, ids, mask)             # the routers are themselves again after the block
    assert torch.equal(replayed, free) and torch.equal(after, free)
    moe_layers = len(routing_replay.moe_routers(model))
    assert stats.differing == 0 and stats.decisions == moe_layers * sum(n - 1 for n in lengths)


@pytest.mark.parametrize("kind,norm", MODELS)
def test_other_routes_change_the_logprobs_and_count_as_differing(kind, norm):
    model = tiny_moe(kind, norm)
    ids, mask, lengths = padded_batch()
    routes = own_routes(model, ids, mask)
    num_experts = next(iter(routing_replay.moe_routers(model).values())).num_experts
    other = disjoint(routes, num_experts)              # other experts at every routed row
    routed = routed_rows(lengths, ids.shape[1])
    with torch.no_grad():
        free = logprobs(model, ids, mask)
        stats = routing_replay.RouteStats()
        with routing_replay.replay(model, other, routed, stats):
            replayed = logprobs(model, ids, mask)
        counted = routing_replay.RouteStats()
        with routing_replay.replay(model, other, routed, counted, force=False):
            unforced = logprobs(model, ids, mask)
    valid = mask[:, 1:].bool()
    assert (replayed - free)[valid].abs().mean() > 1e-2
    assert torch.equal(unforced, free)                 # force=False only counts
    assert counted.differing == counted.decisions > 0
    # The first token's row is routed by the replay and nothing before it differs: its next-token log-prob moved.
    assert ((replayed - free)[:, 0].abs() > 1e-4).all()
    # Rows that carry no route are the router's own choice: nothing routed, nothing changed.
    with torch.no_grad(), routing_replay.replay(model, other, torch.zeros_like(routed)):
        assert torch.equal(logprobs(model, ids, mask), free)


@pytest.mark.parametrize("kind,norm", MODELS)
def test_gradients_reach_every_router_under_replay(kind, norm):
    model = tiny_moe(kind, norm)
    ids, mask, lengths = padded_batch()
    routes = disjoint(own_routes(model, ids, mask), next(iter(routing_replay.moe_routers(model).values())).num_experts)
    with routing_replay.replay(model, routes, routed_rows(lengths, ids.shape[1])):
        loss = -(logprobs(model, ids, mask) * mask[:, 1:]).sum()
    loss.backward()
    for i, router in routing_replay.moe_routers(model).items():
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0, f"layer {i}"
    if not norm:
        return
    # Renormalised weights over the replayed top-k: their gradient with respect to the router's logits is the same
    # function the router's own top-k has, so the check above is not a by-product of unnormalised probabilities.
    logits = torch.randn(5, 4, requires_grad=True)
    idx = torch.topk(logits, 2, dim=-1).indices
    w = routing_replay._weights(routing_replay.moe_routers(model)[0], logits, idx, torch.empty(0))
    assert torch.allclose(w, torch.softmax(logits.gather(-1, idx), dim=-1), atol=1e-6)


def test_routes_that_do_not_fit_the_model_are_refused():
    model = tiny_moe("mixtral")
    ids, mask, lengths = padded_batch()
    routes = own_routes(model, ids, mask)
    routed = routed_rows(lengths, ids.shape[1])
    with pytest.raises(ValueError, match="expert >= 4"):
        with routing_replay.replay(model, routes + 4, routed):
            pass
    with pytest.raises(ValueError, match="top-1"):
        with routing_replay.replay(model, routes[..., :1], routed):
            pass
    with pytest.raises(ValueError, match="router saw"), torch.no_grad():
        with routing_replay.replay(model, routes, routed):
            model(input_ids=ids[:, :5], attention_mask=mask[:, :5])       # not the [B, L] the routes were packed for
    assert not any("forward" in vars(r) for r in routing_replay.moe_routers(model).values())   # restored on error


def test_pack_routes_pads_like_the_tokens():
    a = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2) % 4      # rows 0-1 of a 3-token sequence
    b = np.ones((4, 3, 2), dtype=np.uint16)                            # from row 1, past row 2: capped at length - 1
    routes, routed = routing_replay.pack_routes([a, b, None], [0, 1, 0], [3, 4, 5], width=6, layers=3, top_k=2)
    assert routes.shape == (3, 6, 3, 2) and routes.dtype == torch.long
    assert routed.tolist() == [[True, True, False, False, False, False],
                               [False, True, True, False, False, False],
                               [False] * 6]
    assert torch.equal(routes[0, :2], torch.from_numpy(a.astype(np.int64)))
    with pytest.raises(ValueError, match="expected"):
        routing_replay.pack_routes([a], [0], [3], width=6, layers=4, top_k=2)


def test_mismatch_mean_abs_and_k3():
    t = torch.tensor([[-1.0, -2.0, -3.0]])
    r = torch.tensor([[-1.0, -2.5, -9.0]])
    m = torch.tensor([[True, True, False]])
    mean_abs, k3 = routing_replay.mismatch(t, r, m)
    assert mean_abs == pytest.approx(0.25)
    assert k3 == pytest.approx((0 + (np.exp(0.5) - 1 - 0.5)) / 2, rel=1e-6)
    assert routing_replay.mismatch(r, r, m) == (0.0, 0.0)


@pytest.fixture(scope="module")
def moe_policy_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-moe-policy")
    tiny_moe("mixtral").save_pretrained(d)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    return str(d)


def rollouts_with_routes(model, n=6, seed=3, flip_every=0):
    """Rollouts whose routes are the model's own (each sample alone), with every `flip_every`-th routed row's experts
    swapped for others (a rollout engine that routed some tokens differently); rollout log-probs are the model's own
    under those routes."""
    from trainer_example.rollouts import Rollout

    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = g.integers(1, VOCAB, size=int(g.integers(3, 6))).tolist()
        gen = g.integers(1, VOCAB, size=int(g.integers(3, 8)))
        seq = torch.tensor([prompt + gen.tolist()])
        routes = own_routes(model, seq, torch.ones_like(seq))[0, :-1]              # [rows, layers, k]
        if flip_every:
            routes[::flip_every] = disjoint(routes[::flip_every], 4)
        routed = torch.ones(1, seq.shape[1], dtype=torch.bool)
        routed[0, -1] = False
        full = torch.cat([routes, torch.zeros_like(routes[:1])])[None]
        with torch.no_grad(), routing_replay.replay(model, full, routed):
            lp = logprobs(model, seq, torch.ones_like(seq))[0, len(prompt) - 1:].numpy()
        out.append(Rollout(group=i // 3, prompt_ids=prompt, token_ids=gen, rollout_logp=lp, reward=float(i % 2),
                           correct=bool(i % 2), oldest_version=0, draft_version=0, num_drafted=0, num_accepted=0,
                           advantage=float(i % 2) * 2 - 1, routes=routes.numpy().astype(np.uint8)))
    return out


@pytest.mark.parametrize("replay", ["on", "off"])
def test_trainer_step_on_an_moe_policy_logs_the_mismatch_both_ways(moe_policy_dir, replay):
    from trainer_example.rollouts import pack
    from trainer_example.train import Trainer, parse_args

    torch.manual_seed(0)
    t = Trainer(moe_policy_dir, parse_args(["--micro-batch", "2", "--minibatches", "2", "--lr", "1e-3",
                                            "--temperature", "1", "--routing-replay", replay]), None)
    assert t.moe and t.replay == (replay == "on")
    packed = pack(rollouts_with_routes(t.policy, flip_every=3))
    parts = t.minibatches(packed.input_ids.shape[0])
    old = t.recompute(packed, parts)
    other = t.counterfactual(packed)
    stats = t.train(packed, parts, old)
    row = t.routing_metrics(packed, old, other)
    assert not torch.isnan(old[packed.gen_mask]).any()          # train() completed pi_old for the first part
    # The rollouts' log-probs are the policy's own under the engine's routes: replay reproduces them (batched and
    # padded against one sample at a time), the trainer's own routing does not.
    assert row["logp_mismatch_replay"] < 1e-5 and row["kl_k3_replay"] < 1e-9
    assert row["logp_mismatch_no_replay"] > 1e-3 and row["kl_k3_no_replay"] > 1e-7
    assert 0.2 < row["routes_differing"] <= 1 and row["route_decisions"] > 0
    # Trained on the replayed pass: importance weights pi_old / pi_rollout are 1; trained without: they are not.
    if replay == "on":
        assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    else:
        assert abs(stats["is_weight_mean"] - 1.0) > 1e-4


def test_a_dense_policy_has_no_routing(tmp_path):
    from trainer_example.rollouts import pack
    from trainer_example.train import Trainer, parse_args
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"t0": 0}, unk_token="t0"))).save_pretrained(
        tmp_path)
    t = Trainer(str(tmp_path), parse_args([]), None)
    assert not t.moe and t.push_weights() is t.policy
    assert t.counterfactual(pack(rollouts_with_routes(tiny_moe("mixtral"), n=2))) is None


@pytest.mark.parametrize("tied", [False, True])
def test_an_moe_policy_is_pushed_under_the_checkpoints_names(moe_policy_dir, tmp_path, tied):
    """transformers 5 fuses the experts in memory; the service validates a push against the checkpoint's names
    (block_sparse_moe.experts.{e}.w1/w2/w3), so the trainer pushes those, with the tensors it trains; a tied
    embedding goes once, under the embedding's name (the upcycled SmolLM2 ties them)."""
    import shutil

    from rollout_client.weights import state_tensors
    from rollout_service.weights.manifest import read_manifest
    from trainer_example.train import Trainer, parse_args

    if tied:
        from transformers import MixtralForCausalLM

        model = MixtralForCausalLM.from_pretrained(moe_policy_dir)
        model.config.tie_word_embeddings = True
        MixtralForCausalLM(model.config).save_pretrained(tmp_path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{moe_policy_dir}/{f}", tmp_path)
        moe_policy_dir = str(tmp_path)
    t = Trainer(moe_policy_dir, parse_args([]), None)
    manifest = read_manifest(moe_policy_dir, "float32")
    pushed = dict(state_tensors(t.push_weights()))
    for name, tensor in pushed.items():
        assert manifest.check_tensor(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
    manifest.check_complete(pushed, partial=False)
    with torch.no_grad():
        t.policy.model.layers[1].mlp.experts.gate_up_proj[2, 0, 0] = 7.0      # gate rows first: w1
        t.policy.model.layers[1].mlp.experts.down_proj[3, 0, 0] = 9.0
    pushed = dict(state_tensors(t.push_weights()))
    assert float(pushed["model.layers.1.block_sparse_moe.experts.2.w1.weight"][0, 0]) == 7.0
    assert float(pushed["model.layers.1.block_sparse_moe.experts.3.w2.weight"][0, 0]) == 9.0
