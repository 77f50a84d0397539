"""Adam's parameters, bounded where requests arrive (gateway/protocol.py) and again before a step
(trainer_service/training.py): one table, so the two agree."""

# Upper bounds, far above any useful value: a typo (learning_rate=1e4) would otherwise be applied
# and blow every weight up. Adam moves a weight by about learning_rate per step; AdamW scales it
# by 1 - learning_rate * weight_decay, so with both <= 1 it never flips sign.
ADAM_MAX = {"learning_rate": 1.0, "weight_decay": 1.0, "eps": 1.0}
