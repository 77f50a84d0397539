"""Each loss against a value computed by hand on a tiny batch."""

import math

import pytest
import torch

from tinkerd.errors import UserError
from trainer_service.losses import get_loss

LP = torch.tensor([-1.0, -2.0])
Q = torch.tensor([-1.5, -1.0])
ADV = torch.tensor([2.0, -1.0])


def test_cross_entropy_uses_weights_including_negative():
    loss = get_loss("cross_entropy")(LP, {"weights": torch.tensor([1.0, -0.5])}, {})
    assert loss.tolist() == [1.0, -1.0]


def test_importance_sampling():
    loss = get_loss("importance_sampling")(LP, {"logprobs": Q, "advantages": ADV}, {})
    assert loss.tolist() == pytest.approx([-math.exp(0.5) * 2, math.exp(-1.0) * 1])


def test_ppo_clips_the_ratio():
    loss = get_loss("ppo")(LP, {"logprobs": Q, "advantages": ADV}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    # token 0: r=e^0.5=1.65, A=2 -> min(3.30, 1.2*2=2.4) = 2.4; token 1: r=e^-1=0.37, A=-1 -> min(-0.37, -0.8) = -0.8
    assert loss.tolist() == pytest.approx([-2.4, 0.8])


def test_dro():
    loss = get_loss("dro")(LP, {"logprobs": Q, "advantages": ADV}, {"beta": 0.1})
    assert loss.tolist() == pytest.approx([-(-2.0 - 0.05 * 0.25), -(2.0 - 0.05 * 1.0)])


def test_missing_inputs_and_unknown_loss_are_user_errors():
    with pytest.raises(UserError, match="advantages"):
        get_loss("importance_sampling")(LP, {"logprobs": Q}, {})
    with pytest.raises(UserError, match="unknown"):
        get_loss("no_such_loss")


def test_cispo_stops_the_gradient_through_the_clipped_ratio():
    lp = LP.clone().requires_grad_(True)
    loss = get_loss("cispo")(lp, {"logprobs": Q, "advantages": ADV}, {})
    # r = (e^0.5 -> clipped 1.2, e^-1 -> clipped 0.8): loss = -r * lp * A
    assert loss.tolist() == pytest.approx([-1.2 * -1.0 * 2.0, -0.8 * -2.0 * -1.0])
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-1.2 * 2.0, -0.8 * -1.0])


def test_gspo_uses_one_ratio_per_sequence():
    # A prompt token (q = 0, A = 0) and two sampled tokens.
    lp = torch.tensor([-0.3, -1.0, -2.0], requires_grad=True)
    q = torch.tensor([0.0, -1.2, -1.9])
    adv = torch.tensor([0.0, 1.0, 1.0])
    loss = get_loss("gspo")(lp, {"logprobs": q, "advantages": adv}, {"clip_low_threshold": 0.5,
                                                                    "clip_high_threshold": 2.0})
    s = math.exp(((-1.0 + 1.2) + (-2.0 + 1.9)) / 2)          # exp(mean(lp - q)) over the sampled tokens
    assert loss.sum().item() == pytest.approx(-s * 1.0)        # -min(s A, clip(s) A), unclipped
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.0, -s / 2, -s / 2])
    clipped = get_loss("gspo")(lp, {"logprobs": q, "advantages": adv}, {})   # default range 1-3e-4..1+4e-4
    assert clipped.sum().item() == pytest.approx(-(1 + 4e-4))


def test_stable_reinforce_truncates_the_importance_weight():
    loss = get_loss("stable_reinforce")(LP, {"logprobs": Q, "advantages": ADV}, {"truncation": 1.5})
    # r = e^0.5 = 1.65 -> 1.5; r = e^-1 = 0.37
    assert loss.tolist() == pytest.approx([-1.5 * -1.0 * 2.0, -math.exp(-1.0) * -2.0 * -1.0])
