"""A batch larger than the trainer's activation budget goes through forward and backward in
micro-batches (trainer_service/microbatches.py) and trains exactly as one pass would: the same
per-datum outputs, metrics and adapter, every micro-batch within the budget. The cookbook's
arithmetic RL batch on SmolLM2 (128 datums) kept ~12 GiB of activations in one pass and got the
trainer OOM-killed; the probe that prices a token is checked against what a real step keeps."""

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from tinkerd import custom_loss as spec_mod
from trainer_service import microbatches, prefix_tree, training
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec
from loss_examples import ppo_loss

ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
BUDGET_TOKENS = 40      # the split engine's budget: the 24-datum batch below needs ~10 micro-batches


def _rl_batch(n: int, seed: int) -> list[DatumInput]:
    gen = torch.Generator().manual_seed(seed)
    data = []
    for m in torch.randint(3, 30, (n,), generator=gen).tolist():
        data.append(DatumInput(torch.randint(0, 1000, (m,), generator=gen).tolist(), {
            "target_tokens": torch.randint(0, 1000, (m,), generator=gen), "weights": torch.rand(m, generator=gen),
            "logprobs": -5 * torch.rand(m, generator=gen), "advantages": torch.randn(m, generator=gen)}))
    return data


def test_plan_keeps_a_batch_that_fits_whole_and_in_order():
    ten = microbatches.TokenCost(fixed=10, per_position=0)
    assert microbatches.plan([5, 9, 2], ten, budget_bytes=3 * 9 * 10) == [[0, 1, 2]]
    assert microbatches.plan([], ten, budget_bytes=1) == []


def test_plan_splits_longest_first_within_the_budget():
    lengths = [5, 30, 7, 30, 2, 12, 40, 1]
    groups = microbatches.plan(lengths, microbatches.TokenCost(fixed=3, per_position=0), budget_bytes=3 * 64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [6] and groups[1] == [1, 3]     # 40 alone (2 x 40 > 64), then both 30s
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) * 3 <= 3 * 64
        assert lengths[g[0]] == max(lengths[i] for i in g)
    # a datum over the budget alone goes alone
    assert microbatches.plan([100, 1], microbatches.TokenCost(fixed=1, per_position=0), budget_bytes=50) == [[0], [1]]
    # the per-position term: 4 datums of 10 fit 40 bytes + 4 x 10 x 10 x 0.5 = 240 bytes
    cost = microbatches.TokenCost(fixed=1, per_position=0.5)
    assert cost.of(4, 10) == 240 and microbatches.plan([10] * 4, cost, 240) == [[0, 1, 2, 3]]
    assert microbatches.plan([10] * 4, cost, 239) == [[0, 1, 2], [3]]


def _rollouts(groups: int, per_group: int, prompt: int, completion: int, seed: int) -> list[DatumInput]:
    """An RL batch: `groups` prompts sampled `per_group` times, all sharing a first turn."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, 1000, (8,), generator=gen).tolist()
    data = []
    for _ in range(groups):
        shared = first + torch.randint(0, 1000, (prompt - 8,), generator=gen).tolist()
        for _ in range(per_group):
            tokens = shared + torch.randint(0, 1000, (completion,), generator=gen).tolist()
            n = len(tokens)
            data.append(DatumInput(tokens, {"target_tokens": torch.randint(0, 1000, (n,), generator=gen),
                                            "weights": torch.ones(n), "logprobs": -torch.rand(n, generator=gen),
                                            "advantages": torch.randn(n, generator=gen)}))
    return data


def test_a_batch_of_token_trees_is_priced_as_its_trees():
    """Rollouts sharing their prompts pack into trees far smaller than their padded batch: priced
    as those, fewer micro-batches hold them within the same budget (each group's datums in token
    order, so that prompts stay together), and datums that share nothing are priced padded."""
    data = _rollouts(groups=8, per_group=8, prompt=30, completion=10, seed=1)
    tokens = [d.tokens for d in data]
    lengths = [len(t) for t in tokens]
    order = sorted(range(len(data)), key=lambda i: tokens[i])
    cost = microbatches.TokenCost(fixed=10_000, per_position=0,
                                  tree=microbatches.TreeCost(per_node=8_000, per_path_token=2_000))
    budget = 10_000 * 40 * 16                                     # 16 padded datums of 40 tokens
    padded = microbatches.plan(lengths, cost, budget, order)
    trees = microbatches.plan(lengths, cost, budget, order, tokens)
    assert [len(g) for g in padded] == [16] * 4
    assert len(trees) < len(padded) and sum(trees, []) == order
    for g in trees:           # within the budget as the trees the engine packs them into
        targets = torch.cat([data[i].loss_fn_inputs["target_tokens"] for i in g])
        packed = prefix_tree.pack([tokens[i] for i in g], targets)
        assert packed is not None
        assert cost.tree.of(*packed.ids.shape, sum(lengths[i] for i in g), 40) <= budget
    unshared = [list(range(k * 40, k * 40 + 40)) for k in range(64)]
    assert len(microbatches.plan([40] * 64, cost, budget, list(range(64)), unshared)) == 4


def _custom_ppo():
    handle = trace_loss(ppo_loss, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}, "s")
    spec = spec_mod.parse(handle.name, [i.model_dump() for i in handle.inputs],
                          encode_graph(handle).model_dump(mode="json"))
    return "s:loss:0", spec.canonical


def _custom_inputs(data: list[DatumInput]) -> list[DatumInput]:
    return [DatumInput(d.tokens, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                  "old_logprobs": d.loss_fn_inputs["logprobs"],
                                  "advantages": d.loss_fn_inputs["advantages"]}) for d in data]


def _train(engine: TrainerEngine, loss_fn: str) -> dict:
    """Two steps on 24 datums, then a forward: every output and metric, and the adapter."""
    engine.create_model(loss_fn, LoraSpec(rank=8, seed=5))
    custom = _custom_ppo() if loss_fn == "custom" else None
    seen = {}
    for step in range(2):
        data = _rl_batch(24, seed=step)
        if custom:
            data = _custom_inputs(data)
        outputs, metrics = engine.forward_backward(loss_fn, data, loss_fn, {}, forward_only=False, custom_loss=custom)
        seen[f"{step}.metrics"] = metrics
        seen[f"{step}.logprobs"] = [o["logprobs"] for o in outputs]
        seen[f"{step}.losses"] = [o["elementwise_loss"] for o in outputs]
        seen[f"{step}.gradient"] = torch.cat([p.grad.flatten() for p in engine.get(loss_fn).params])
        seen[f"{step}.optim"] = engine.optim_step(loss_fn, ADAM)
    outputs, _ = engine.forward_backward(loss_fn, _rl_batch(24, seed=9), "cross_entropy", {}, forward_only=True)
    seen["final.logprobs"] = [o["logprobs"] for o in outputs]
    seen["adapter"] = engine.export_adapter(loss_fn)[0]
    return seen


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    whole = TrainerEngine(tiny_model_dir, zero_stage=2)
    split = TrainerEngine(tiny_model_dir, zero_stage=2)
    split.activation_budget = BUDGET_TOKENS * split.token_cost.fixed
    return whole, split


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "gspo", "custom"])
def test_a_batch_over_the_budget_trains_as_one_pass_would(engines, monkeypatch, loss_fn):
    """Per-token losses over the batch at once (cross_entropy, importance_sampling), a sequence
    loss per datum (gspo), a server-side custom loss: micro-batches change nothing but the order
    of sums: the gradient of each call within 1e-5 of its largest entry, outputs and metrics
    within 1e-5 (fp32)."""
    whole, split = engines
    want = _train(whole, loss_fn)
    shapes, build = [], training._batch
    monkeypatch.setattr(training, "_batch", lambda data, device, packable: shapes.append(
        (len(data), max(len(d.tokens) for d in data))) or build(data, device, packable))
    got = _train(split, loss_fn)

    backward_shapes = shapes[:-1]      # the last: the forward-only call, one pass
    assert len(backward_shapes) >= 2 * 8, shapes
    for n, longest in backward_shapes:
        assert n * longest <= BUDGET_TOKENS or n == 1, shapes
    assert shapes[-1][0] == 24
    for key in want:
        if key == "adapter":
            # Adam moves each weight by ~lr x g / |g|: a gradient near zero (the custom PPO's
            # clipped tokens) moves it by its rounding's sign, so after two steps the weights agree
            # less than the gradients do (1.2e-4 there, the others <= 2e-6).
            for name in want[key]:
                assert torch.allclose(got[key][name], want[key][name], atol=2e-4), \
                    (name, (got[key][name] - want[key][name]).abs().max())
        elif key.endswith("gradient"):
            assert (got[key] - want[key]).abs().max() <= 1e-5 * want[key].abs().max(), key
        elif key.endswith("metrics") or key.endswith("optim"):
            assert got[key].keys() == want[key].keys()
            for name, value in want[key].items():
                assert got[key][name] == pytest.approx(value, rel=1e-5, abs=1e-5), (key, name)
        else:
            assert len(got[key]) == len(want[key]) == 24
            for g, w in zip(got[key], want[key]):
                assert torch.allclose(g, w, atol=1e-5), key


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_prices_a_token_above_what_a_real_step_keeps(tiny_model_dir, dtype):
    """What autograd really keeps in a step (adapters up to the largest rank, padded batches of
    short and long datums, logits in chunks) is at most what the start-up probe charges, and not
    far below it: the budget neither overflows nor wastes most of itself."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=2, max_lora_rank=16, max_logits_mib=1, dtype=dtype)
    for rank in (1, 16):
        engine.create_model(f"r{rank}", LoraSpec(rank=rank, seed=1))
        for n, seed in ((24, 3), (4, 4)):
            data = _rl_batch(n, seed=seed)
            if n == 4:          # long datums: the per-position term
                data = [DatumInput(d.tokens * 8, {k: v.repeat(8) for k, v in d.loss_fn_inputs.items()}) for d in data]
            kept = microbatches.saved_bytes(engine.peft, lambda: engine.forward_backward(
                f"r{rank}", data, "importance_sampling", {}, forward_only=False))
            charged = engine.token_cost.of(n, max(len(d.tokens) for d in data))
            assert 0.5 * charged <= kept <= charged, (rank, n, kept, charged)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_prices_token_trees_above_what_a_real_step_keeps(tiny_model_dir, dtype):
    """The same for a batch that goes as token trees, priced by the trees' rows and the datums'
    paths (microbatches.TreeCost, fitted from a packed probe at start-up)."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=2, max_lora_rank=16, max_logits_mib=1, dtype=dtype)
    assert engine.packable and engine.token_cost.tree is not None
    engine.create_model("m", LoraSpec(rank=16, seed=1))
    for groups, per_group, prompt, completion in ((4, 8, 40, 12), (2, 4, 200, 30)):
        data = _rollouts(groups, per_group, prompt, completion, seed=5)
        tokens = [d.tokens for d in data]
        packed = prefix_tree.pack(tokens, torch.cat([d.loss_fn_inputs["target_tokens"] for d in data]))
        assert packed is not None
        kept = microbatches.saved_bytes(engine.peft, lambda: engine.forward_backward(
            "m", data, "importance_sampling", {}, forward_only=False))
        order = sorted(range(len(data)), key=lambda i: tokens[i])
        group = microbatches._Group(engine.token_cost, tokens, [len(t) for t in tokens])
        for i in order:
            group.add(i)
        charged = group.bytes()
        assert group.trees.rows == packed.ids.shape[0]
        assert group.trees.rows * group.trees.width >= packed.ids.numel()    # pack balances its rows
        assert 0.5 * charged <= kept <= charged, (groups, kept, charged, engine.token_cost, group.trees)
        assert charged < 0.8 * engine.token_cost.of(len(data), max(map(len, tokens))), engine.token_cost


def test_the_default_budget_is_a_share_of_the_host_s_memory(tiny_model_dir):
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < microbatches.default_budget_bytes(torch.device("cpu")) <= host // 16
    engine = TrainerEngine(tiny_model_dir, zero_stage=2, activation_mib=64)
    assert engine.activation_budget == 64 << 20
