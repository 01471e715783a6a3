"""The calculator tool task (rollout_tasks/calculator.py) and the trainer's multi-turn episodes (trainer_example/
episodes.py), without a service: the tool's safe evaluation, the reward on the final answer, the per-episode tool
metrics, and the collation of an episode's exact token sequence into the trainer's rows with the loss on the
sampled tokens only."""
import json

import numpy as np
import pytest
import torch

from rollout_client.episode import Episode
from rollout_client.types import AssistantMessage, Sample, ToolCall
from rollout_tasks import calculator as calc
from trainer_example import episodes, grpo
from trainer_example.rollouts import Rollout, assign_advantages, pack


# ---- the tool ----

@pytest.mark.parametrize("expression, value", [
    ("1 + 2", "3"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("1 / 3", "0.3333333333"),
    ("-5 - -3", "-2"), ("+4", "4"), ("2.5 * 4", "10"), (" 3*  4 ", "12"), ("0.1 + 0.2", "0.3"), ("100 - 150", "-50"),
])
def test_calculator_values(expression, value):
    assert calc.calculator(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("2 ** 10", "unsupported: Pow"), ("7 // 2", "unsupported: FloorDiv"), ("7 % 2", "unsupported: Mod"),
    ("__import__('os').system('echo hi')", "unsupported: Call"), ("x + 1", "unsupported: Name"),
    ("[1, 2]", "unsupported: List"), ("'a' * 3", "unsupported: Constant"), ("True + 1", "unsupported: Constant"),
    ("1 / 0", "division by zero"), ("1 / (2 - 2)", "division by zero"), ("3 +", "cannot parse"),
    ("", "cannot parse"), ("1" + " + 1" * 100, "longer than 200"), ("99999999 * 99999999 * 99999999", "too large"),
    ("1e308 * 10", "too large"), ("lambda: 1", "unsupported: Lambda"), ("(1).__class__", "unsupported: Attribute"),
])
def test_calculator_refuses_everything_else_as_text(expression, error):
    out = calc.calculator(expression)
    assert out.startswith("error: ") and error in out


def test_calculator_never_evaluates_code(monkeypatch):
    import builtins

    monkeypatch.setattr(builtins, "eval", lambda *a, **k: pytest.fail("eval called"))
    monkeypatch.setattr(builtins, "exec", lambda *a, **k: pytest.fail("exec called"))
    assert calc.calculator("open('/etc/passwd').read()").startswith("error: unsupported: Call")
    assert calc.calculator("2 * 21") == "42"


def test_calculator_takes_a_number_and_refuses_other_types():
    assert calc.calculator(12) == "12" and calc.calculator(2.5) == "2.5"
    assert calc.calculator(None).startswith("error: expression must be a string")
    assert calc.calculator(True).startswith("error: expression must be a string")
    with pytest.raises(calc.CalculatorError):
        calc.evaluate("2 ** 3")


def test_the_tool_and_prompt():
    fn = calc.TOOL["function"]
    assert calc.TOOL["type"] == "function" and fn["name"] == calc.NAME == "calculator"
    assert fn["parameters"]["required"] == ["expression"] and json.loads(json.dumps(calc.TOOLS)) == calc.TOOLS
    p = calc.split(1, max_ops=1)[0]
    msgs = calc.first_messages(p)
    assert [m["role"] for m in msgs] == ["system", "user"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[1]["content"].startswith(p.question) and "Answer: <number>" in msgs[1]["content"]
    # the system prompt's example is the call the hermes parser reads
    example = msgs[0]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    assert json.loads(example) == {"name": "calculator", "arguments": {"expression": "12 + 7"}}


def test_the_task_imports_neither_the_service_nor_the_trainer_nor_the_client():
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(calc.__file__).read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in mods if m.split(".")[0] in ("rollout_service", "trainer_example", "rollout_client")}


# ---- reward and metrics on an episode's messages ----

def call(expression, name="calculator", cid="c1", raw=None):
    args = raw if raw is not None else json.dumps({"expression": expression})
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def episode_messages(*turns):
    """first messages, then (assistant content, [calls], [tool results]) turns."""
    msgs = calc.first_messages(calc.Problem("Ben has 4 coins. Then Ben gets 8 more. How many?", 12))
    for content, calls, results in turns:
        msgs.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        for c, r in zip(calls, results):
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": r})
    return msgs


def test_reward_is_on_the_final_answer_only():
    tool_then_answer = episode_messages((None, [call("4 + 8")], ["12"]), ("4 + 8 = 12.\nAnswer: 12", [], []))
    assert calc.episode_reward(tool_then_answer, 12) == pytest.approx(1.1)
    assert calc.episode_reward(episode_messages(("Answer: 12", [], [])), 12) == pytest.approx(1.1)   # no tool: same
    assert calc.episode_reward(episode_messages(("so it is 12", [], [])), 12) == pytest.approx(1.0)  # last number
    assert calc.episode_reward(episode_messages(("Answer: 11", [], [])), 12) == pytest.approx(0.1)
    # the calculator was right but the episode ended on a call (out of turns): no answer, no reward
    assert calc.episode_reward(episode_messages((None, [call("4 + 8")], ["12"])), 12) == 0.0
    # an earlier turn's text does not count: only the last assistant message
    earlier = episode_messages(("Answer: 12", [call("4 + 8")], ["12"]), ("hmm, 13", [], []))
    assert calc.episode_reward(earlier, 12) == pytest.approx(0.0)
    assert calc.episode_reward(calc.first_messages(calc.split(1)[0]), 12) == 0.0      # no turn at all
    parts = episode_messages(("x", [], []))
    parts[-1]["content"] = [{"type": "text", "text": "Answer: "}, {"type": "text", "text": "12"}]
    assert calc.episode_reward(parts, 12) == pytest.approx(1.1)                        # multi-part content


def test_episode_metrics():
    m = calc.episode_metrics(episode_messages((None, [call("4 + 8")], ["12"]), ("Answer: 12", [], [])), 12)
    assert m == {"turns": 2, "calls": 1, "attempts": 1, "well_formed": 1, "tool_errors": 0, "calc_hit": True,
                 "correct": True, "answer_line": True}
    # an unparsed attempt (left in the content), a call with a bad argument name, one to an unknown tool, and a
    # well-formed one whose result is not the answer
    bad = episode_messages(
        ("let me <tool_call>\n{\"name\": calculator}\n</tool_call>", [], []),
        (None, [call(None, raw='{"expr": "4 + 8"}', cid="a"), call("4 + 8", name="add", cid="b"),
                call("4 * 8", cid="c")], ["error: TypeError", "error: no tool named 'add'", "32"]),
        ("Answer: 32", [], []))
    m = calc.episode_metrics(bad, 12)
    assert m == {"turns": 3, "calls": 3, "attempts": 4, "well_formed": 1, "tool_errors": 2, "calc_hit": False,
                 "correct": False, "answer_line": True}
    assert not calc.well_formed(call("2 ** 3")) and not calc.well_formed(call(None, raw="{not json"))
    assert not calc.well_formed(call(None, raw='{"expression": 3}')) and calc.well_formed(call("3"))
    s = calc.summarize([calc.episode_metrics(episode_messages(("Answer: 12", [], [])), 12),
                        calc.episode_metrics(bad, 12)])
    assert s["tool_call_rate"] == 0.5 and s["attempt_rate"] == 0.5 and s["calls_per_episode"] == 1.5
    assert s["well_formed_rate"] == 0.25 and s["turns_per_episode"] == 2.0 and s["accuracy"] == 0.5
    assert s["tool_error_rate"] == pytest.approx(2 / 3) and s["calc_hit_rate"] == 0.0 and s["format_rate"] == 1.0
    assert calc.summarize([calc.episode_metrics(episode_messages(("12", [], [])), 12)])["well_formed_rate"] is None


# ---- episodes as the trainer's rows ----

def sample(prompt, tokens, message, finish="stop", version=3, drafted=0):
    return Sample(prompt_index=0, sample_index=0, token_ids=np.asarray(tokens, dtype=np.int64),
                  logprobs=np.asarray([-0.1 * (i + 1) for i in range(len(tokens))], dtype=np.float32),
                  finish_reason=finish, stop_string="", policy_version=version, version_spans=[(version, 0)],
                  draft_version=0, num_drafted=drafted, num_accepted=drafted // 2, text="",
                  num_prompt_tokens=len(prompt), prompt_token_ids=np.asarray(prompt, dtype=np.int64),
                  message=message)


class FakeClient:
    """chat_step as RolloutClient runs it, with a scripted model: even episodes call the calculator on turn 1 then
    answer; odd ones answer at once. The server's render is faked as 3 inserted tokens per new message."""

    def __init__(self, answer_text="Answer: 12"):
        self.calls, self.answer_text = [], answer_text

    def chat_step(self, eps, **kw):
        live = [e for e in eps if not e.done]
        if live:                                   # the real client sends no request without a live episode
            self.calls.append(kw)
        for e in live:
            i = eps.index(e)
            new = len(e.messages) - e.num_rendered
            prompt = e.token_ids + [40 + (len(e.token_ids) + j) % 20 for j in range(3 * new)]
            if i % 2 == 0 and not e.turns:
                msg = AssistantMessage(None, None, (ToolCall(f"call-{i}", "calculator", '{"expression": "4 + 8"}'),))
                e.record(sample(prompt, [10, 11, 12, 13], msg, version=3 - (i == 2)))
            else:
                e.record(sample(prompt, [20, 21, 2], AssistantMessage(self.answer_text, None, ()), drafted=4))
        return live


def test_generate_episodes_scores_whole_groups_in_order():
    client = FakeClient()
    problems = [calc.Problem("Ben has 4 coins. Then Ben gets 8 more. How many?", 12),
                calc.Problem("Ava has 20 coins. Then Ava gives away 8. How many?", 12)]
    batch = episodes.generate_episodes(client, problems, episodes.encode(problems), n=2, max_turns=3,
                                       max_tokens=16, temperature=0.5, min_policy_version=2)
    assert batch.num_groups == 2 and [r.group for r in batch.rollouts] == [0, 0, 1, 1]
    assert len(client.calls) == 2 and all(c["min_policy_version"] == 2 and c["max_tokens"] == 16 for c in
                                          client.calls)
    assert all(c["stop"] == ["</tool_call>"] for c in client.calls)     # a turn ends at its call
    called, direct = batch.rollouts[0], batch.rollouts[1]
    assert called.episode["calls"] == 1 and called.episode["turns"] == 2 and called.episode["calc_hit"]
    assert direct.episode["calls"] == 0 and direct.episode["turns"] == 1
    assert all(r.reward == pytest.approx(1.1) and r.correct and r.answer_line for r in batch.rollouts)
    assert batch.rollouts[2].oldest_version == 2        # its first turn came from policy version 2
    assert direct.num_drafted == 4 and called.num_drafted == 4
    s = episodes.summary(batch.rollouts)
    assert s["tool_call_rate"] == 0.5 and s["turns_per_episode"] == 1.5 and s["well_formed_rate"] == 1.0
    assert "accuracy" not in s and s["sampled_tokens"] == pytest.approx((7 + 3) / 2)
    # max_turns bounds the episode: out of turns after the call, no answer, no reward
    short = episodes.generate_episodes(FakeClient(), problems[:1], episodes.encode(problems[:1]), n=2,
                                       max_turns=1, max_tokens=16, temperature=0.5)
    assert [r.reward for r in short.rollouts] == [0.0, pytest.approx(1.1)]


def test_an_episode_packs_into_one_row_with_the_loss_on_sampled_tokens():
    e = Episode.group(calc.first_messages(calc.split(1)[0]), n=1, tools=calc.TOOLS)[0]
    first = [1, 2, 3, 4, 5]
    call_msg = AssistantMessage(None, None, (ToolCall("c", "calculator", '{"expression": "4 + 8"}'),))
    e.record(sample(first, [10, 11, 12], call_msg))
    e.add_tool_result("c", "12", "calculator")
    e.record(sample(e.token_ids + [30, 31, 32, 33], [20, 21], AssistantMessage("Answer: 12", None, ())))
    assert e.token_ids == first + [10, 11, 12] + [30, 31, 32, 33] + [20, 21]
    assert e.mask == [0] * 5 + [1] * 3 + [0] * 4 + [1] * 2
    r = episodes.episode_rollout(e, 0, 12)
    assert r.prompt_ids == first and r.token_ids.tolist() == [10, 11, 12, 30, 31, 32, 33, 20, 21]
    assert r.sampled.tolist() == [True] * 3 + [False] * 4 + [True] * 2
    short = Rollout(group=0, prompt_ids=[1, 2], token_ids=np.asarray([7, 8]), rollout_logp=np.zeros(2, np.float32),
                    reward=0.0, correct=False, oldest_version=3, draft_version=0, num_drafted=0, num_accepted=0)
    packed = pack([r, short])
    seq = first + [10, 11, 12, 30, 31, 32, 33, 20, 21]
    assert packed.input_ids[0].tolist() == seq and packed.attention_mask[0].tolist() == [1] * len(seq)
    # position t predicts token t + 1: the loss mask is the episode's mask shifted by one
    assert packed.gen_mask[0].tolist() == [bool(m) for m in e.mask[1:]]
    assert packed.rollout_logp[0][packed.gen_mask[0]].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.1, -0.2])
    assert (packed.rollout_logp[0][~packed.gen_mask[0]] == 0).all()
    # an arithmetic sample (sampled None): every generated token, as before; padding masked
    assert packed.gen_mask[1].tolist() == [False, True, True] + [False] * (len(seq) - 4)
    assert packed.input_ids[1, :4].tolist() == [1, 2, 7, 8] and packed.attention_mask[1].sum() == 4


def test_the_gradient_reaches_no_inserted_position():
    torch.manual_seed(0)
    e = Episode.group([{"role": "user", "content": "q"}], n=1, tools=calc.TOOLS)[0]
    e.record(sample([1, 2, 3], [10, 11, 12], AssistantMessage(None, None, (ToolCall("c", "calculator",
                                                                                      '{"expression": "1"}'),))))
    e.add_tool_result("c", "1")
    e.record(sample(e.token_ids + [30, 31, 32], [20, 21], AssistantMessage("Answer: 1", None, ())))
    r = episodes.episode_rollout(e, 0, 1)
    r.advantage = 1.0
    packed = pack([r])
    logits = torch.randn(1, packed.input_ids.shape[1], 64, requires_grad=True)
    logp = grpo.token_logprobs(logits[:, :-1], packed.targets, 0.5)
    loss, _ = grpo.grpo_loss(logp, logp.detach(), packed.rollout_logp, packed.advantages, packed.gen_mask)
    loss.backward()
    touched = logits.grad[0, :-1].abs().sum(-1) > 0
    assert touched.tolist() == packed.gen_mask[0].tolist()        # sampled targets only, none of the tool's
    assert int(packed.gen_mask.sum()) == 5


def test_group_advantages_are_per_episode():
    rollouts = [Rollout(group=i // 2, prompt_ids=[1], token_ids=np.asarray([2]), rollout_logp=np.zeros(1, np.float32),
                        reward=rw, correct=False, oldest_version=0, draft_version=0, num_drafted=0, num_accepted=0,
                        sampled=np.asarray([True]))
                for i, rw in enumerate([1.1, 0.0, 0.1, 0.1])]
    from trainer_example.rollouts import Batch

    assign_advantages(Batch(rollouts, 2, 0.0), 2)
    assert [r.advantage for r in rollouts] == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-4)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("tiny-policy")
    LlamaForCausalLM(cfg).save_pretrained(d)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)},
                                                                          unk_token="t0"))).save_pretrained(d)
    return str(d)


def test_the_trainer_steps_on_episodes(policy_dir):
    """A whole step's recompute and training on episodes of different lengths and turns, the loss on their sampled
    tokens; importance weights 1 where the rollout log-probs are the trainer's own."""
    from trainer_example.train import Trainer, parse_args

    torch.manual_seed(0)
    t = Trainer(policy_dir, parse_args(["--task", "calculator", "--micro-batch", "2", "--lr", "1e-2"]), None)
    assert t.args.speculation == "none" and t.args.max_turns == 3
    problems = [calc.Problem("a", 12), calc.Problem("b", 12)]
    batch = episodes.generate_episodes(FakeClient(), problems, episodes.encode(problems), n=2, max_turns=3,
                                       max_tokens=8, temperature=0.5)
    batch.rollouts[1].reward = batch.rollouts[3].reward = 0.0
    assign_advantages(batch, 2)
    packed = pack(batch.rollouts)
    with torch.no_grad():                  # the engine's log-probs = the trainer's: the rollouts are on-policy
        logits = t.policy(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits[:, :-1]
        packed.rollout_logp = torch.where(packed.gen_mask, grpo.token_logprobs(logits, packed.targets, 0.5),
                                          torch.zeros(()))
    parts = t.minibatches(4)
    stats = t.train(packed, parts, t.recompute(packed, parts))
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and stats["loss"] != 0.0
    assert any(float((p - s).detach().abs().sum()) > 0 for p, s in zip(t.policy.parameters(), t.start.parameters()))


def test_refusals():
    from trainer_example.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--task", "calculator", "--model", "moe"])
    with pytest.raises(SystemExit):
        parse_args(["--task", "calculator", "--reward", "brevity"])
    a = parse_args([])
    assert a.task == "arithmetic" and a.speculation == "eagle3"     # the default is unchanged
    assert parse_args(["--task", "calculator", "--speculation", "eagle3"]).speculation == "eagle3"
