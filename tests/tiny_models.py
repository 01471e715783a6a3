"""Models for tests and benchmarks, built in seconds without a hub: a tiny random Llama with SmolLM2's
tokenizer, noisy copies of a model (drafters of known quality), and a tiny Llama trained to call a calculator tool
(real engine output with real tool calls)."""
from __future__ import annotations

import logging
from pathlib import Path

from rollout_service.models import find_gguf, save_atomically


def _tokenizer(tokenizer_from: Path | None):
    """SmolLM2's tokenizer: from `tokenizer_from` (a model dir), else from the packaged GGUF."""
    from transformers import AutoTokenizer

    if tokenizer_from is not None:
        return AutoTokenizer.from_pretrained(tokenizer_from)
    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def build_tiny_model(out: Path, *, layers: int = 2, hidden: int = 128, seed: int = 0,
                     tokenizer_from: Path | None = None, tied: bool = False) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (vocab 49152), float32, built in seconds.

    The tokenizer comes from `tokenizer_from` (a model dir) or from the packaged GGUF.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout_service.chat.template import TEMPLATE

    tok = _tokenizer(tokenizer_from)
    tok.chat_template = TEMPLATE            # the service's tool-aware ChatML (chat/template.py)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        # head_dim 64: vLLM's CPU attention needs >= 32
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=tied,
        torch_dtype="float32", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # logits with std ~4: next-token entropy ~3.7 nats, top token ~0.37, like an LM
        model.model.embed_tokens.weight.normal_(0, 1.0)
        if not tied:
            model.lm_head.weight.normal_(0, 4.0 / hidden ** 0.5)
    save_atomically(model, tok, out)
    return out


def perturbed_copy(src: Path, out: Path, *, scale: float, seed: int = 0) -> Path:
    """A copy of the model at `src` with Gaussian noise (scale x each tensor's std) added: a drafter of
    known quality for tests (scale 0 gives an identical drafter)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if scale:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    save_atomically(model, AutoTokenizer.from_pretrained(src), out)
    return out


def build_tiny_moe_model(out: Path, *, layers: int = 2, hidden: int = 128, experts: int = 8, top_k: int = 2,
                         seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A tiny random Qwen3-MoE (mixture of experts: `experts` per layer, `top_k` routed per token) with SmolLM2's
    tokenizer, float32, built in seconds. Router weights are scaled up so that routing is decisive (top-k margins
    well above float noise: an independent forward pass routes every token the same way)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = _tokenizer(tokenizer_from)
    config = Qwen3MoeConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 2, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, torch_dtype="float32", rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 4.0 / hidden ** 0.5)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0 / hidden ** 0.5)
    save_atomically(model, tok, out)
    return out


# ---- a tiny model that calls a tool ---------------------------------------------------------------------------------
TOOL_CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
# (question, the call's expression, the tool's result): what build_tiny_tool_model learned, word for word
TOOL_PROBLEMS: list[tuple[str, str, str]] = [
    ("What is 3 + 4?", "3 + 4", "7"), ("What is 6 * 7?", "6 * 7", "42"), ("What is 9 - 5?", "9 - 5", "4"),
    ("What is 8 * 3?", "8 * 3", "24"), ("What is 5 + 9?", "5 + 9", "14"), ("What is 8 - 6?", "8 - 6", "2"),
    ("What is 2 * 6?", "2 * 6", "12"), ("What is 1 + 8?", "1 + 8", "9")]
TOOL_THINK_SYSTEM = "Think first."               # this system message makes the model reason before its call:
TOOL_REASONING = "I will use the calculator."    # <think>\nI will use the calculator.\n</think>\n\n<tool_call>...


def tool_conversation(question: str, expression: str, answer: str, *, think: bool = False) -> list[dict]:
    """A whole episode as build_tiny_tool_model learned it (OpenAI chat messages): [system TOOL_THINK_SYSTEM when
    `think`,] the user's question, the assistant's calculator call [after TOOL_REASONING], the tool's result, and the
    assistant's "The answer is {answer}."."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": TOOL_CALCULATOR["function"]["name"],
                                                             "arguments": {"expression": expression}}}]}
    if think:
        call["reasoning_content"] = TOOL_REASONING
    system = [{"role": "system", "content": TOOL_THINK_SYSTEM}] if think else []
    return system + [{"role": "user", "content": question}, call, {"role": "tool", "content": answer},
                     {"role": "assistant", "content": f"The answer is {answer}."}]


def _episode_tokens(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """An episode's tokens as an engine sees them (each prompt rendered and tokenized, each assistant turn sampled
    after it, through its <|im_end|>), and which of them the assistant wrote."""
    import re

    text = tok.apply_chat_template(messages, tools=[TOOL_CALCULATOR], tokenize=False)
    ids: list[int] = []
    sampled: list[bool] = []
    at = 0
    for turn in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, re.S):
        for piece, mine in ((text[at:turn.start(1)], False), (turn.group(1), True)):
            piece_ids = tok(piece, add_special_tokens=False).input_ids
            ids += piece_ids
            sampled += [mine] * len(piece_ids)
        at = turn.end(1)
    # tokenized in pieces = tokenized whole: a prompt that re-renders the history reads the same tokens
    assert ids == tok(text[:at], add_special_tokens=False).input_ids, "the template's pieces tokenize apart"
    return ids, sampled


def build_tiny_tool_model(out: Path, *, seed: int = 0, tokenizer_from: Path | None = None, steps: int = 120) -> Path:
    """build_tiny_model's Llama (2 layers, hidden 128, head_dim 64, float32, SmolLM2's tokenizer with the service's
    template) trained for seconds (Adam, CPU) until it plays each of TOOL_PROBLEMS' episodes (tool_conversation, with
    and without TOOL_THINK_SYSTEM, tools=[TOOL_CALCULATOR]) word for word: given the question, its greedy turn is the
    hermes call `<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call><|im_end|>`
    (after `<think>\nI will use the calculator.\n</think>\n\n` under TOOL_THINK_SYSTEM), and after the tool's
    result "The answer is 7.<|im_end|>". Its output layer is then sharpened until every learned turn has probability
    >= 0.99 at temperature 1, so sampled episodes call the tool too. Deterministic for a seed. Outside these
    episodes it knows nothing (every token it never writes has logit 0).

    How it trains fast: the loss is on the assistant's tokens only; the shared system turn (the tools) is computed
    once per step; the output layer has rows only for the tokens the assistant writes (the others are zero, logit 0,
    so the softmax over the whole vocabulary is exact and cheap); and layer 0's first attention head starts out
    reading the conversation's digits and operators (a constant embedding dimension for its query and a marker one
    on those tokens for its key, in RoPE's slowest pair: blind to position), the problem the model has to recognize.
    `steps` bounds the training; it stops once every token it learned is the greedy one with a margin of 1.5 logits,
    and raises if it never does.
    """
    import math

    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from rollout_service.chat.template import TEMPLATE

    tok = _tokenizer(tokenizer_from)
    tok.chat_template = TEMPLATE
    hidden, vocab = 128, 49152
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
        torch_dtype="float32", rope_theta=10000.0,
    )

    # the episodes, in two batches (without and with the reasoning system message): the tokens all of a batch's
    # episodes start with (the system turn, the tools), then each episode's rest, right-padded
    batches = []
    for think in (False, True):
        episodes = [_episode_tokens(tok, tool_conversation(*p, think=think)) for p in TOOL_PROBLEMS]
        shared = 0
        while all(len(ids) > shared and ids[shared] == episodes[0][0][shared] for ids, _ in episodes):
            shared += 1
        assert not any(any(sampled[:shared + 1]) for _, sampled in episodes)
        length = max(len(ids) for ids, _ in episodes) - shared
        rest = torch.full((len(episodes), length), tok.eos_token_id)
        learned = torch.zeros((len(episodes), length), dtype=torch.bool)
        for i, (ids, sampled) in enumerate(episodes):
            rest[i, :len(ids) - shared] = torch.tensor(ids[shared:])
            learned[i, :len(ids) - shared] = torch.tensor(sampled[shared:])
        # the hidden state at position p predicts token p + 1
        batches.append({"prefix": torch.tensor([episodes[0][0][:shared]]), "rest": rest, "at": learned[:, 1:],
                        "targets": rest[:, 1:][learned[:, 1:]]})
    written = torch.unique(torch.cat([b["targets"] for b in batches]))      # sorted: every token the model writes
    for b in batches:
        b["targets"] = torch.searchsorted(written, b["targets"])             # as rows of `head`
    log_others = math.log(vocab - len(written))                              # the other tokens' logits are 0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # small matrices: on a busy CPU a second thread mostly waits for the first
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        with torch.no_grad():
            embed = model.model.embed_tokens.weight
            embed.normal_(0, 1.0)
            # what makes the problem easy to find: embedding dim 0 is constant, dim 1 marks digits and operators;
            # head 0's query reads dim 0 and its key dim 1 in RoPE's slowest pair (31/63 of 64: ~1e-4 rad a token)
            marked = tok.convert_tokens_to_ids([str(d) for d in range(10)] + ["Ġ+", "Ġ-", "Ġ*"])     # Ġ: a space
            assert tok.unk_token_id not in marked
            embed[:, 0], embed[:, 1] = 2.0, 0.0
            embed[marked, 1] = 4.0
            attn = model.model.layers[0].self_attn
            for proj, dim in ((attn.q_proj, 0), (attn.k_proj, 1)):
                proj.weight[[31, 63]] = 0.0
                proj.weight[31, dim] = 3.2
            model.lm_head.weight.zero_()
        embed.requires_grad_(False)                                           # random inputs, as they are
        head = torch.nn.Parameter(torch.randn(len(written), hidden) * 0.02)   # lm_head's rows for `written`
        body = [p for p in model.model.parameters() if p.requires_grad]
        opt = torch.optim.Adam([{"params": body, "lr": 5e-3}, {"params": [head], "lr": 2e-2}])
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))

        def logits(b):
            """The logits over `written` at the batch's learned positions."""
            cached = DynamicCache(config=config)
            model.model(input_ids=b["prefix"], past_key_values=cached, use_cache=True)
            n, length = b["rest"].shape
            shared = b["prefix"].shape[1]
            cache = DynamicCache(config=config)
            for i, layer in enumerate(cached.layers):
                cache.update(layer.keys.expand(n, -1, -1, -1), layer.values.expand(n, -1, -1, -1), i)
            h = model.model(input_ids=b["rest"], past_key_values=cache, use_cache=True,
                            position_ids=torch.arange(shared, shared + length).expand(n, -1)).last_hidden_state
            return h[:, :-1][b["at"]] @ head.T

        def scores(z, b):
            """Each learned token's log-probability (over the whole vocabulary) and its margin over the best other,
            from the batch's logits `z`."""
            right = z.gather(1, b["targets"][:, None])[:, 0]
            total = torch.logsumexp(torch.cat([z, torch.full((len(z), 1), log_others)], 1), 1)
            other = z.scatter(1, b["targets"][:, None], -math.inf).max(1).values.clamp(min=0)
            return right - total, right - other

        for step in range(steps + 1):
            logp, margin = map(torch.cat, zip(*(scores(logits(b), b) for b in batches)))
            if margin.min() >= 1.5:
                break
            if step == steps:
                raise RuntimeError(f"the tool model did not learn its episodes in {steps} steps (seed {seed}): "
                                   f"{int((margin <= 0).sum())} tokens wrong")
            weight = -logp.detach() + 0.02       # the hard tokens (the problem's digits) weigh most
            loss = (-logp * weight).sum() / weight.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(body + [head], 1.0)
            opt.step()
            schedule.step()

        # sharpen: the least scale (up to 16) at which every learned turn has probability >= 0.99 at temperature 1
        with torch.no_grad():
            final = [logits(b) for b in batches]
            for scale in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0):
                worst = 0.0
                for z, b in zip(final, batches):
                    logp, _ = scores(z * scale, b)
                    per_token = torch.zeros(b["at"].shape)
                    per_token[b["at"]] = logp
                    turn = torch.cumsum(~b["at"], 1)          # tokens of one turn share a count of unlearned ones
                    for row, ids in zip(per_token, turn):
                        sums = torch.zeros(int(ids.max()) + 1).index_add_(0, ids, row)
                        worst = min(worst, float(sums.min()))
                if worst >= math.log(0.99):
                    break
            else:
                raise RuntimeError(f"the tool model's turns stay unlikely at temperature 1 (seed {seed})")
            model.lm_head.weight[written] = head * scale
        logging.getLogger(__name__).info("tool model: learned in %d steps, output sharpened x%g", step, scale)
    finally:
        torch.set_num_threads(threads)
    save_atomically(model, tok, out)
    return out
