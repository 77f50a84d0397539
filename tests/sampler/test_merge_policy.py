"""The promotion policy (which snapshots merged slots serve) and the merged weights, without vLLM."""

from __future__ import annotations

import pytest
import torch

from harness.models import build_lora_adapter
from sampler_service.merged import (Decision, PromotionPolicy, UnmergeableError, lora_factors, merged_checkpoint,
                                    read_adapter)


def _feed(policy, *requests):
    decisions = []
    for sid, tokens in requests:
        decisions += policy.observe(sid, tokens)
    return decisions


def test_promotes_the_snapshot_with_most_of_the_traffic_after_min_requests():
    policy = PromotionPolicy(slots=1, window=8, share=0.5, min_requests=3)
    assert _feed(policy, ("a", 10), ("a", 10)) == []                         # under min_requests
    assert _feed(policy, ("a", 10)) == [Decision("promote", "a", 0)]
    assert _feed(policy, ("a", 10), ("b", 10)) == []                         # a already merged, b cold


def test_share_is_by_tokens_not_requests():
    policy = PromotionPolicy(slots=1, window=8, share=0.5, min_requests=2)
    assert _feed(policy, ("", 100), ("small", 1), ("small", 1), ("small", 1)) == []   # 3 of 4 requests, 3% of tokens
    assert _feed(policy, ("big", 200)) == []
    assert _feed(policy, ("big", 200)) == [Decision("promote", "big", 0)]


def test_demotes_when_traffic_moves_and_the_new_hot_snapshot_takes_the_slot():
    policy = PromotionPolicy(slots=1, window=4, share=0.5, min_requests=2)
    assert _feed(policy, ("a", 10), ("a", 10)) == [Decision("promote", "a", 0)]
    assert _feed(policy, ("b", 10), ("b", 10)) == []                         # a at 50%, b at 50%: no swap on a tie
    assert _feed(policy, ("b", 10)) == [Decision("demote", "a", 0), Decision("promote", "b", 0)]   # 25% vs 75%
    assert policy.slots == ["b"]


def test_base_model_traffic_demotes_without_promoting():
    policy = PromotionPolicy(slots=1, window=4, share=0.5, min_requests=1)
    assert _feed(policy, ("a", 10)) == [Decision("promote", "a", 0)]
    assert _feed(policy, ("", 10), ("", 10), ("", 10)) == []                 # a at 25%: not under half of 0.5
    assert _feed(policy, ("", 10)) == [Decision("demote", "a", 0)]
    assert policy.slots == [None]


def test_a_bigger_share_takes_the_slot_of_a_smaller_one():
    policy = PromotionPolicy(slots=1, window=10, share=0.3, min_requests=1)
    assert _feed(policy, ("a", 10), ("a", 10), ("a", 10), ("a", 10)) == [Decision("promote", "a", 0)]
    _feed(policy, *[("b", 10)] * 4)
    assert policy.slots == ["a"]                                             # b 50% > a 50%? no: a tie
    assert _feed(policy, ("b", 10)) == [Decision("demote", "a", 0), Decision("promote", "b", 0)]


def test_two_slots_and_off():
    policy = PromotionPolicy(slots=2, window=4, share=0.4, min_requests=2)
    assert _feed(policy, ("a", 10), ("b", 10), ("a", 10), ("b", 10)) == [Decision("promote", "a", 0),
                                                                         Decision("promote", "b", 1)]
    off = PromotionPolicy(slots=0, window=4, share=0.5, min_requests=1)
    assert _feed(off, *[("a", 10)] * 8) == [] and off.slots == []


def test_a_refused_snapshot_is_never_promoted_again():
    policy = PromotionPolicy(slots=1, window=4, share=0.5, min_requests=1)
    assert _feed(policy, ("a", 10)) == [Decision("promote", "a", 0)]
    policy.refuse("a", 0)
    assert policy.slots == [None] and _feed(policy, *[("a", 10)] * 4) == []


def test_a_runs_new_snapshot_takes_its_merged_predecessors_slot_with_its_traffic():
    """RL: each step saves a snapshot and samples all of it at once; the window cannot see it get
    hot before every request was admitted, so it succeeds its run's merged snapshot on arrival."""
    policy = PromotionPolicy(slots=1, window=8, share=0.5, min_requests=3)
    assert policy.arrived("r@1", "run") == []                                # nothing merged yet
    assert _feed(policy, ("r@1", 10), ("r@1", 10), ("r@1", 10)) == [Decision("promote", "r@1", 0)]
    assert policy.arrived("other@1", "other") == []                          # another run: no claim
    assert policy.arrived("r@2", "run") == [Decision("demote", "r@1", 0), Decision("promote", "r@2", 0)]
    assert policy.slots == ["r@2"] and policy.promised("r@2") and not policy.promised("r@1")
    assert _feed(policy, ("r@2", 10)) == []              # the run's 3 requests count as r@2's: not demoted
    assert policy.shares()["r@2"] == 1.0
    policy.refuse("r@3", 0)                                                  # unmergeable
    assert policy.arrived("r@3", "run") == [] and policy.slots == ["r@2"]
    assert policy.arrived("x", "") == []                                     # run unknown (persisted copy)


def test_traffic_moving_back_to_an_older_snapshot_still_wins_its_slot_back():
    policy = PromotionPolicy(slots=1, window=4, share=0.5, min_requests=2)
    policy.arrived("r@1", "run")
    _feed(policy, ("r@1", 10), ("r@1", 10))
    policy.arrived("r@2", "run")
    assert _feed(policy, ("r@1", 10), ("r@1", 10)) == []                     # r@2 inherited 2 of 4: a tie
    assert _feed(policy, ("r@1", 10)) == [Decision("demote", "r@2", 0), Decision("promote", "r@1", 0)]


@pytest.mark.parametrize("bad", [dict(slots=-1), dict(window=0), dict(share=1.5), dict(min_requests=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="merged serving"):
        PromotionPolicy(**{**dict(slots=1, window=4, share=0.5, min_requests=1), **bad})


def test_merged_weights_equal_peft_merge_and_unload(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = str(build_lora_adapter(tiny_model_dir, tmp_path / "a", rank=8, seed=3, std=0.1))
    merged = dict(merged_checkpoint(tiny_model_dir, lora_factors(*read_adapter(path)), torch.float32))
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                     path).merge_and_unload().state_dict()
    assert set(want) == set(merged)
    for name, tensor in want.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)


def test_unmergeable_adapters_are_refused():
    a, b = torch.zeros(2, 4), torch.zeros(4, 2)
    with pytest.raises(UnmergeableError, match="DoRA"):
        lora_factors({"base_model.model.x.lora_A.weight": a, "base_model.model.x.lora_B.weight": b},
                    {"r": 2, "use_dora": True})
    with pytest.raises(UnmergeableError, match="not a LoRA"):
        lora_factors({"base_model.model.x.lora_embedding_A": a}, {"r": 2})
    with pytest.raises(UnmergeableError, match="lacks"):
        lora_factors({"base_model.model.x.lora_A.weight": a}, {"r": 2})
