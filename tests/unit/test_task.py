from trainer_example.task import EVAL_SEED_OFFSET, extract_answer, make_problem, reward, split


def test_problems_are_deterministic_and_checkable():
    p = make_problem(42)
    assert p == make_problem(42) and p != make_problem(43)
    assert "Answer:" in p.prompt and p.question.endswith("now?")


def test_answer_matches_the_story():
    p = make_problem(7, steps=1)
    assert isinstance(p.answer, int) and p.answer >= 0


def test_reward_cases():
    assert reward("blah\nAnswer: 12", 12) == 1.0
    assert reward("Answer: 11", 12) == 0.1
    assert reward("I think 12", 12) == 0.0
    assert reward("Answer: 3\nmore text\nAnswer: 12", 12) == 1.0      # the last answer line counts
    assert reward("Answer: -4", -4) == 1.0
    assert extract_answer("Answer:  5 ") == 5


def test_eval_split_is_disjoint_from_training():
    train = {p.question for p in split(300)}
    evals = {p.question for p in split(300, eval=True)}
    assert len(train & evals) < 5     # different seeds; identical stories only by coincidence
    assert EVAL_SEED_OFFSET > 1_000_000
