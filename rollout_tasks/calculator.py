"""A multi-turn tool task: arithmetic word problems (arithmetic.py's generator) that the model may solve with a
`calculator` tool. An episode is: the problem, then turns in which the model either calls the calculator (a Hermes
`<tool_call>` the server's parser reads; the tool's result comes back as the next message) or answers. The reward is
on the FINAL answer only: the last assistant message's content, read with arithmetic.py's rules (1 for a correct
final answer, plus 0.1 for an 'Answer: N' line). Calling the tool earns nothing by itself.

Pure functions on OpenAI chat messages (dicts), like the rest of rollout_tasks: no service, no client, no trainer.

    messages = first_messages(problem)            # system + user; the tools go beside them (TOOL)
    calculator("(12 + 7) * 3")  -> "57"           # what the tool answers; errors as text, never an exception
    episode_reward(messages, problem.answer)      # after the episode: its messages, the assistant's turns included
    episode_metrics(messages, problem.answer)     # tool calls made, well-formed, the calculator's result right
"""
from __future__ import annotations

import ast
import json
import math
import operator
import re

from rollout_tasks.arithmetic import Problem, extract_answer, final_answer, make_problem, reward, split  # noqa: F401

NAME = "calculator"
TOOL = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses; returns its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example \"(12 + 7) * 3\""}},
            "required": ["expression"],
        },
    },
}
TOOLS = [TOOL]
SYSTEM = ("You are a helpful assistant who solves math word problems. You can use a calculator: to compute something, "
          "reply with only a tool call, for example\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": "
          "{\"expression\": \"12 + 7\"}}\n</tool_call>\nand you will get its result. When you know the answer, end "
          "with a line of the form 'Answer: <number>'.")
# "First call the calculator": SmolLM2-135M-Instruct at temperature 0.5 then reads 9% of episodes as calls (25% try,
# 22% of tries well-formed), against none in 32 for "You may use the calculator" (2026-12-06, 8 problems x 4).
INSTRUCTION = ("First call the calculator with the expression to compute, then end with a line of the form "
               "'Answer: <number>'.")

# A turn ends at its call: SmolLM2-135M writes on after `</tool_call>` until max_tokens (no end of turn), and a turn
# cut by max_tokens ends the episode before the tool runs (rollout_client.Episode). Stopped here, the server reads the
# call and closes the turn itself (its end-of-turn marker inserted, mask 0) before the tool's result.
STOP = ["</tool_call>"]
MAX_EXPRESSION = 200                 # characters
MAX_MAGNITUDE = 1e15                 # larger intermediate values are refused (no 10**10**10 by repeated products)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
TOOL_CALL_RE = re.compile(r"<tool_call>")


class CalculatorError(ValueError):
    pass


def user_message(problem: Problem) -> str:
    return f"{problem.question}\n{INSTRUCTION}"


def first_messages(problem: Problem) -> list[dict]:
    """An episode's first messages: the system prompt (how to call the tool; the chat template appends the tools'
    signatures to it) and the problem."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(problem)}]


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: integer and decimal numbers, + - * /, unary + -, parentheses; nothing
    else is evaluated (the text is parsed with `ast`, never run). CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        x = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        x = _OPS[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        x = _UNARY[type(node.op)](_value(node.operand))
    else:
        what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
        raise CalculatorError(f"unsupported: {what} (numbers, + - * / and parentheses only)")
    if (isinstance(x, float) and not math.isfinite(x)) or abs(x) > MAX_MAGNITUDE:
        raise CalculatorError("number too large")
    return x


def format_number(x: int | float) -> str:
    """12.0 -> '12', 3.5 -> '3.5', 1/3 -> '0.3333333333'."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.10g}"


def calculator(expression: str) -> str:
    """The tool: an expression's value as text, or 'error: ...' (the model reads its mistake as the tool's answer)."""
    if isinstance(expression, (int, float)) and not isinstance(expression, bool):
        expression = str(expression)        # {"expression": 12}: a number is its own value
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"error: {e}"


# ---- after an episode: its messages (the first ones, then assistant turns and tool results) ----

def final_content(messages: list[dict]) -> str:
    """The last assistant message's content ("" when it has none, e.g. it only called a tool)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return _text(m.get("content"))
    return ""


def episode_reward(messages: list[dict], answer: int) -> float:
    """arithmetic.reward on the final answer: the last assistant message's content. An episode that ended on a tool
    call (no answer after it, e.g. out of turns) scores 0."""
    return reward(final_content(messages), answer)


def episode_correct(messages: list[dict], answer: int) -> bool:
    return final_answer(final_content(messages)) == answer


def well_formed(call: dict) -> bool:
    """A parsed call (OpenAI tool_calls entry) of the calculator whose arguments are a JSON object with a string
    `expression` the calculator evaluates."""
    fn = call.get("function") or call
    if fn.get("name") != NAME:
        return False
    try:
        args = json.loads(fn.get("arguments") or "")
    except (TypeError, ValueError):
        return False
    if not isinstance(args, dict) or set(args) != {"expression"} or not isinstance(args["expression"], str):
        return False
    return not calculator(args["expression"]).startswith("error")


def episode_metrics(messages: list[dict], answer: int) -> dict:
    """Per episode: turns (assistant messages), calls (tool calls the server's parser read), attempts (those plus
    `<tool_call>` openings the parser could not read, left in the content), well_formed (parsed calls of the
    calculator with a valid expression), tool_errors (tool results starting 'error'), calc_hit (a calculator result
    equals the right answer), correct (the final answer), answer_line (the final message has an 'Answer: N' line)."""
    assistant = [m for m in messages if m.get("role") == "assistant"]
    calls = [c for m in assistant for c in m.get("tool_calls") or []]
    unparsed = sum(len(TOOL_CALL_RE.findall(_text(m.get("content")))) for m in assistant)
    results = [_text(m.get("content")) for m in messages if m.get("role") == "tool"]
    final = final_content(messages)
    return {"turns": len(assistant), "calls": len(calls), "attempts": len(calls) + unparsed,
            "well_formed": sum(well_formed(c) for c in calls),
            "tool_errors": sum(r.startswith("error") for r in results),
            "calc_hit": any(_number(r) == answer for r in results),
            "correct": final_answer(final) == answer, "answer_line": extract_answer(final) is not None}


def summarize(metrics: list[dict]) -> dict:
    """A batch of episode_metrics: tool_call_rate (episodes with a parsed call), attempt_rate (with any attempt),
    calls_per_episode, well_formed_rate (well-formed / attempted calls; None without attempts), tool_error_rate,
    calc_hit_rate, turns_per_episode, accuracy, format_rate."""
    n = max(len(metrics), 1)
    attempts = sum(m["attempts"] for m in metrics)
    return {"tool_call_rate": sum(m["calls"] > 0 for m in metrics) / n,
            "attempt_rate": sum(m["attempts"] > 0 for m in metrics) / n,
            "calls_per_episode": sum(m["calls"] for m in metrics) / n,
            "attempts_per_episode": attempts / n,
            "well_formed_rate": sum(m["well_formed"] for m in metrics) / attempts if attempts else None,
            "tool_error_rate": sum(m["tool_errors"] for m in metrics) / max(sum(m["calls"] for m in metrics), 1),
            "calc_hit_rate": sum(m["calc_hit"] for m in metrics) / n,
            "turns_per_episode": sum(m["turns"] for m in metrics) / n,
            "accuracy": sum(m["correct"] for m in metrics) / n,
            "format_rate": sum(m["answer_line"] for m in metrics) / n}


def _text(content) -> str:
    """A message's content as text: a string, None, or a list of {"type": "text", "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None
