"""`rollout-grpo --task calculator` end to end on the tiny model's real service (tools rendered by the service's
template, calls parsed by vLLM's hermes parser, episodes through rollout_client.Episode): two sync steps, each
pushing the policy; the trainer's log-probs of the episodes' sampled tokens, from a forward pass over the whole
rendered sequence, agree with the engine's (importance weights 1: the collation puts the loss on exactly the
sampled positions), and every step logs the episodes' tool use. The tiny random model calls no tool by itself, so
the trainer's episodes end after one turn; a first turn constrained to a calculator call (a named tool_choice) gives
real multi-turn episodes, whose collated rows the trainer's forward pass scores exactly as the engine sampled them."""
import json
import math

import pytest
import torch

from rollout_client import Episode, RolloutClient, run_episodes
from rollout_client.episode import call_tools
from rollout_tasks import calculator as calc
from tests.integration.services import running_service
from trainer_example import episodes, grpo
from trainer_example.rollouts import pack
from trainer_example.train import main as train_main


@pytest.fixture(scope="module")
def calc_service(tiny_model, tmp_path_factory):
    with running_service(tiny_model, tmp_path_factory.mktemp("logs") / "calculator.log") as svc:
        yield svc


def test_calculator_task_trains_on_episodes(calc_service, tiny_model, tmp_path):
    with RolloutClient(calc_service.target) as c:
        before = c.status().policy_version
    out = tmp_path / "calc"
    assert train_main(["--target", calc_service.target, "--model", str(tiny_model), "--task", "calculator",
                       "--steps", "2", "--prompts", "2", "--group-size", "2", "--max-tokens", "16", "--max-turns", "2",
                       "--eval-size", "2", "--eval-every", "100", "--kl-samples", "2", "--no-save-final",
                       "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and [r["policy_version"] for r in rows] == [before, before + 1]
    for r in rows:
        assert r["samples"] == 4 and math.isfinite(r["loss"])
        assert abs(r["is_weight_mean"] - 1) < 0.02 and r["rollout_logp_mismatch"] < 1e-3, r
        assert 1 <= r["turns_per_episode"] <= 2 and 0 <= r["tool_call_rate"] <= 1 and r["calls_per_episode"] >= 0
        # the rendered prompt (system, tools, problem) comes first; at most 2 turns of 16 sampled tokens follow
        assert r["episode_tokens"] > 200 and 0 < r["sampled_tokens"] <= 32
    assert "eval_tool_call_rate" in rows[-1] and "eval_before_tool_call_rate" in rows[0]
    with RolloutClient(calc_service.target) as c:
        assert c.status().policy_version == before + 2


def test_a_multi_turn_episode_collates_into_the_engines_sequence(calc_service, tiny_model):
    """Turn 1 constrained to a calculator call (its log-probs are the constrained distribution's), the tool's result
    inserted by the server, turn 2 sampled freely: the trainer's row is the episode's exact tokens, its loss mask the
    sampled tokens, and its forward pass gives turn 2's sampled tokens the engine's log-probs."""
    from transformers import AutoModelForCausalLM

    problem = calc.Problem("Ben has 4 coins. Then Ben gets 8 more. How many coins does Ben have now?", 12)
    eps = Episode.group([{"role": "user", "content": calc.user_message(problem)}], n=4, tools=calc.TOOLS,
                        tool_choice={"type": "function", "function": {"name": "calculator"}})
    with RolloutClient(calc_service.target) as c:
        c.chat_step(eps, max_tokens=64, temperature=1.0, stop=calc.STOP)
        called = [e for e in eps if not e.done]
        assert called, [(e.turns[0].finish_reason, e.turns[0].message) for e in eps]
        for e in called:
            assert e.turns[0].stop_string == "</tool_call>" and e.tool_calls[0].name == "calculator"
            call_tools(e, {calc.NAME: calc.calculator})
            e.tool_choice = None                    # turn 2 on: the model's own choice
        run_episodes(c, called, {calc.NAME: calc.calculator}, max_turns=1, max_tokens=16, temperature=1.0,
                     stop=calc.STOP)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for e in called:
        r = episodes.episode_rollout(e, 0, problem.answer)
        assert r.episode["turns"] == 2 and r.episode["calls"] >= 1
        packed = pack([r])
        assert packed.input_ids[0].tolist() == e.token_ids
        assert packed.gen_mask[0].tolist() == [bool(m) for m in e.mask[1:]]
        second = len(e.turns[1].prompt_token_ids)            # turn 2's first sampled token
        inserted = e.mask[len(e.turns[0].prompt_token_ids) + len(e.turns[0].token_ids):second]
        assert inserted and set(inserted) == {0}            # the turn's close and the tool's result
        with torch.no_grad():
            logits = model(input_ids=packed.input_ids).logits[:, :-1]
        logp = grpo.token_logprobs(logits, packed.targets, 1.0)[0]
        turn2 = torch.arange(second - 1, len(e.token_ids) - 1)
        assert (logp[turn2] - packed.rollout_logp[0, turn2]).abs().max() < 2e-3
