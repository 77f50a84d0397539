"""The optimizers a model is created with (fixed for its life), by Tinker's names, and Dimuon's
per-step parameters' bounds, checked where requests arrive (gateway/protocol.py) and again before a
step (trainer_service/training.py): one table, so the two agree. Adam's are tinkerd/adam.py."""

ADAMW, DIMUON = "adamw", "dimuon"
OPTIMIZERS = (ADAMW, DIMUON)

# The SDK's class of each optimizer's per-step parameters, for messages naming a mismatch.
PARAMS_CLASS = {ADAMW: "AdamParams", DIMUON: "DimuonParams"}

# Tinker's defaults for what an older SDK's DimuonParams leaves out.
DIMUON_DEFAULTS = {"beta1": 0.9, "damping": 1e-4, "rank_lr_correction_exponent": 0.175, "grad_clip_norm": 0.0}

# Upper bounds, far above any useful value, as ADAM_MAX: a typo would otherwise be applied. A step
# moves each LoRA matrix by learning_rate * sqrt(rank) (Frobenius), times the rank correction,
# (rank / 32) ** -exponent, which stays finite for any rank with |exponent| <= 4.
DIMUON_MAX = {"learning_rate": 1.0, "damping": 1e6, "rank_lr_correction_exponent": 4.0}
