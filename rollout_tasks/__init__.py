"""Verifiable RL tasks, shared by the service's offline tools and by trainers; they import neither.

arithmetic.py: word problems with a checkable answer and a pure reward. The bundled GRPO trainer
(trainer_example/) trains on them, and `rollout-service prepare-drafter` trains the default drafter on the
target's own samples of them: the RL domain the drafter has to predict. Pure Python, no dependencies.
"""
