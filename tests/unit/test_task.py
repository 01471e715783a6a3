from rollout_tasks.arithmetic import (EVAL_SEED_OFFSET, correct, extract_answer, final_answer, make_problem,
                                      reward, split)


def test_problems_are_deterministic_and_checkable():
    p = make_problem(42)
    assert p == make_problem(42) and p != make_problem(43)
    assert "Answer:" in p.prompt and p.question.endswith("now?")


def test_answer_matches_the_story():
    p = make_problem(7, steps=1)
    assert isinstance(p.answer, int) and p.answer >= 0
    assert p.question.count("Then") == 1
    assert all(q.question.count("Then") == 1 for q in split(50, max_ops=1))
    assert {q.question.count("Then") for q in split(200)} == {1, 2, 3}


def test_reward_cases():
    assert reward("blah\nAnswer: 12", 12) == 1.1                      # correct, on an answer line
    assert reward("Answer: 11", 12) == 0.1                             # well-formed, wrong
    assert reward("I think 12", 12) == 1.0                             # correct final number, no answer line
    assert reward("12 or maybe 13", 12) == 0.0                         # the last number counts
    assert reward("no idea", 12) == 0.0
    assert reward("Answer: 3\nmore text\nAnswer: 12", 12) == 1.1      # the last answer line counts
    assert reward("Answer: 12\nthen 7 more", 12) == 1.1                # an answer line beats later numbers
    assert reward("Answer: -4", -4) == 1.1
    assert extract_answer("Answer:  5 ") == 5 and extract_answer("5") is None
    assert final_answer("5 apples") == 5 and final_answer("") is None
    assert correct("so 3 + 4 = 7", 7) and not correct("7 - 4 = 3", 7)


def test_eval_split_is_disjoint_from_training():
    train = {p.question for p in split(300)}
    evals = {p.question for p in split(300, eval=True)}
    assert len(train & evals) < 5     # different seeds; identical stories only by coincidence
    assert EVAL_SEED_OFFSET > 1_000_000
