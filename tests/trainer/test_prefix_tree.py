"""Datums that share prefixes (an RL batch's rollouts of one prompt) go through the model as token
trees, each shared token once (trainer_service/prefix_tree.py), and train exactly as padded
datums do: the same logprobs per position, losses, metrics and gradients, for every kind of loss,
in micro-batches too, at ZeRO-2 and ZeRO-3."""

import pytest
import torch

from trainer_service import prefix_tree, training
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec

ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


def _rollouts(groups: int, per_group: int, seed: int) -> list[DatumInput]:
    """`groups` prompts (a common few-shot opening, then each its own question) x `per_group`
    sampled continuations, as the cookbook's RL datums: tokens = prompt + completion[:-1]."""
    gen = torch.Generator().manual_seed(seed)
    opening = torch.randint(3, 1000, (9,), generator=gen).tolist()
    data = []
    for _ in range(groups):
        prompt = opening + torch.randint(3, 1000, (int(torch.randint(4, 20, (1,), generator=gen)),),
                                         generator=gen).tolist()
        for _ in range(per_group):
            completion = torch.randint(3, 1000, (int(torch.randint(2, 12, (1,), generator=gen)),),
                                       generator=gen).tolist()
            sequence = prompt + completion
            n = len(sequence) - 1
            data.append(DatumInput(sequence[:-1], {
                "target_tokens": torch.tensor(sequence[1:]), "weights": torch.rand(n, generator=gen),
                "logprobs": -5 * torch.rand(n, generator=gen), "advantages": torch.randn(n, generator=gen)}))
    return data


def test_a_group_s_prompt_is_one_path_of_the_tree():
    data = _rollouts(3, 4, seed=0)
    tokens = [d.tokens for d in data]
    targets = torch.cat([d.loss_fn_inputs["target_tokens"] for d in data])
    packed = prefix_tree.pack(tokens, targets)
    assert packed is not None
    assert packed.ids.shape[0] == 1                  # 12 short datums: one row
    # nodes: the opening once, each prompt's question once, every completion's own tokens
    row = packed.ids[0]
    flat_targets = packed.targets[packed.expand]
    assert torch.equal(flat_targets, targets)        # every datum token finds its own target
    width = packed.ids.shape[1]
    start = 0
    for d in data:
        n = len(d.tokens)
        at = packed.unembed[packed.expand[start:start + n]]          # its positions, in order
        start += n
        assert at.div(width, rounding_mode="floor").unique().numel() == 1
        nodes = at % width
        assert row[nodes].tolist() == d.tokens                       # its tokens, along its path
        assert packed.positions[0, nodes].tolist() == list(range(n))  # at their depths
        for j, node in enumerate(nodes.tolist()):                    # attending to its own path only
            assert packed.mask[0, 0, node].nonzero().squeeze(1).tolist() == sorted(nodes[:j + 1].tolist())
    assert len(set(packed.unembed.tolist())) < len(targets) * 0.6   # shared positions unembedded once


def test_datums_that_share_nothing_go_padded_as_before():
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (30, 7, 18, 25)]
    targets = torch.randint(3, 1000, (80,), generator=gen)
    assert prefix_tree.pack(tokens, targets) is None          # padding alone: left as it was
    same = [tokens[0]] * 4                                     # four copies: one path
    assert prefix_tree.pack(same, torch.randint(3, 1000, (120,), generator=gen)).ids.shape == (1, 30)
    prefix = [tokens[0], tokens[0][:10], tokens[0][:20]]       # datums that are others' prefixes
    packed = prefix_tree.pack(prefix, torch.randint(3, 1000, (60,), generator=gen))
    assert packed.ids.shape == (1, 30)


def test_sharing_that_the_rows_cap_cuts_goes_padded():
    """Two 300-token datums sharing 250: one row of 350 nodes when rows hold 512 tokens; when they
    hold 300, the second starts a row of its own, shares nothing, and the batch goes padded (the
    quick count of the fewest nodes passes it on; the laid-out rows decide)."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 1000, (250,), generator=gen).tolist()
    tokens = [shared + torch.randint(3, 1000, (50,), generator=gen).tolist() for _ in range(2)]
    targets = torch.randint(3, 1000, (600,), generator=gen)
    assert prefix_tree.pack(tokens, targets).ids.shape == (1, 350)
    assert prefix_tree.pack(tokens, targets, row_tokens=300) is None


def test_rows_are_balanced_not_filled(tiny_model_dir, monkeypatch):
    """Rows filled to 512 tokens left the last one short, and every row is padded to the longest:
    4 prompts x 8 rollouts of 52 tokens (40 shared) are 544 tree positions, filled into 2 rows of
    508 (1,016 positions computed); balanced, 2 rows of 272. The datums' logprobs are the same."""
    gen = torch.Generator().manual_seed(3)
    tokens = []
    for _ in range(4):
        prompt = torch.randint(3, 1000, (40,), generator=gen).tolist()
        tokens += [prompt + torch.randint(3, 1000, (12,), generator=gen).tolist() for _ in range(8)]
    targets = torch.randint(3, 1000, (52 * 32,), generator=gen)
    lengths, shares = [52] * 32, [0] + [40 if i % 8 else 0 for i in range(1, 32)]
    assert prefix_tree.rows_of(lengths, shares, 512) == (2, 508)
    assert prefix_tree.pack(tokens, targets).ids.shape == (2, 272)

    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("m", LoraSpec(rank=8, seed=1))
    data = [DatumInput(t, {"target_tokens": targets[52 * i:52 * (i + 1)]}) for i, t in enumerate(tokens)]

    def logprobs():
        outputs, _ = engine.forward_backward("m", data, "cross_entropy", {}, forward_only=True)
        return torch.cat([o["logprobs"] for o in outputs])
    balanced = logprobs()
    monkeypatch.setattr(prefix_tree, "balanced_cap", lambda lengths, shares, cap: cap)
    torch.testing.assert_close(balanced, logprobs(), rtol=0, atol=1e-6)


def _train(engine: TrainerEngine, model_id: str, loss_fn: str) -> dict:
    engine.create_model(model_id, LoraSpec(rank=8, seed=5))
    seen = {}
    for step in range(2):
        data = _rollouts(4, 6, seed=step)
        outputs, metrics = engine.forward_backward(model_id, data, loss_fn, {}, forward_only=False)
        seen[f"{step}.loss"] = metrics["loss:sum"]
        seen[f"{step}.logprobs"] = [o["logprobs"] for o in outputs]
        seen[f"{step}.losses"] = [o["elementwise_loss"] for o in outputs]
        seen[f"{step}.gradient"] = torch.cat([p.grad.flatten() for p in engine.get(model_id).params]) \
            if engine.zero_stage != 3 else None
        seen[f"{step}.grad_norm"] = engine.optim_step(model_id, ADAM)["grad_norm:mean"]
    outputs, _ = engine.forward_backward(model_id, _rollouts(4, 6, seed=7), "cross_entropy", {}, forward_only=True)
    seen["final.logprobs"] = [o["logprobs"] for o in outputs]
    return seen


@pytest.mark.parametrize("stage, loss_fn", [(2, "importance_sampling"), (2, "gspo"), (2, "cross_entropy"),
                                            (3, "ppo")])
def test_rollouts_as_trees_train_as_padded_datums_do(tiny_model_dir, monkeypatch, stage, loss_fn):
    padded = TrainerEngine(tiny_model_dir, zero_stage=stage)
    padded.packable = False
    want = _train(padded, "m", loss_fn)
    del padded

    trees = TrainerEngine(tiny_model_dir, zero_stage=stage)
    assert trees.packable                                    # a Llama: its own head, no sliding window
    trees.activation_budget = 60 * trees.token_cost.fixed    # in micro-batches (priced as trees), groups together
    packed, pack = [], prefix_tree.pack
    monkeypatch.setattr(prefix_tree, "pack", lambda *a, **k: packed.append(pack(*a, **k)) or packed[-1])
    got = _train(trees, "m", loss_fn)
    trees_ = [p for p in packed if p is not None]       # (a micro-batch of two datums may not pay)
    assert len(packed) >= 8 and len(trees_) >= 0.75 * len(packed), [p is not None for p in packed]
    assert sum(p.ids.numel() for p in trees_) < 0.6 * sum(p.expand.numel() for p in trees_)  # positions: < 60%

    for key, value in want.items():
        if value is None:
            continue
        if key.endswith("gradient"):
            assert (got[key] - value).abs().max() <= 1e-5 * value.abs().max(), key
        elif isinstance(value, list):
            assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got[key], value)), key
        else:
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def test_a_padded_sft_batch_is_untouched(tiny_model_dir, monkeypatch):
    """No shared prefixes: the batch goes padded, as before (bit for bit the same path)."""
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("m", LoraSpec(rank=4, seed=1))
    built = []
    build = training._batch
    monkeypatch.setattr(training, "_batch", lambda data, device, packable: built.append(
        build(data, device, packable)) or built[-1])
    gen = torch.Generator().manual_seed(3)
    data = [DatumInput(torch.randint(3, 1000, (n,), generator=gen).tolist(),
                       {"target_tokens": torch.randint(3, 1000, (n,), generator=gen)}) for n in (12, 30, 7)]
    engine.forward_backward("m", data, "cross_entropy", {}, forward_only=False)
    assert built[0].ids.shape == (3, 30) and "position_ids" not in built[0].how


def _tiny(model_type: str, attention: str = "sdpa", **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape, **config),
                                             attn_implementation=attention)
    return model


def test_only_models_whose_attention_runs_paths_pack():
    llama = _tiny("llama")
    assert prefix_tree.install(llama) and llama.config._attn_implementation == prefix_tree.TREE_ATTENTION
    assert prefix_tree.install(_tiny("qwen2", sliding_window=4096, use_sliding_window=False))
    assert not prefix_tree.install(_tiny("mistral", sliding_window=4096))     # a custom mask would override it
    assert not prefix_tree.install(_tiny("llama", "eager"))                  # takes masks its own way
    gemma = _tiny("gemma2")                                                   # soft-capped: not a plain head
    assert not prefix_tree.install(gemma) and gemma.config._attn_implementation == "sdpa"     # left as it was


def _rollout_logprobs(engine: TrainerEngine, data: list[DatumInput], packable: bool) -> list[torch.Tensor]:
    engine.packable = packable
    outputs, _ = engine.forward_backward("m", data, "cross_entropy", {}, forward_only=True)
    return [o["logprobs"] for o in outputs]


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory) -> str:
    """Wide and deep enough for bf16 rounding to tell one attention layout from another (the
    2-layer tiny model's logprobs come out equal whichever way its attention runs)."""
    from harness.models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "wider", hidden_size=256, num_layers=6))


def _attention_alike_in_longer_sequences() -> bool:
    """Whether this host's fp32 attention gives the first queries of a sequence the same outputs as
    the sequence alone: the AVX2-only VM's kernel does; AVX-512 ones (with or without bf16) sum a
    query's keys otherwise at some lengths (2.4e-7 apart at 15 tokens in 16), which bf16 can round
    into another value downstream (prefix_tree.py's docstring)."""
    gen = torch.Generator().manual_seed(0)
    for length in range(2, 49):
        q, k, v = (torch.randn(1, 2, length + 1, 32, generator=gen) for _ in range(3))
        whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, :length]
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, :length], k[:, :, :length],
                                                                 v[:, :, :length], is_causal=True)
        if not torch.equal(whole, alone):
            return False
    return True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_datum_in_a_tree_gets_its_logprobs_alone(wider_model_dir, monkeypatch, dtype):
    """As the sampler computes it: each sequence alone, with the sampler's rounding in bf16
    (cpu_numerics): attention runs path by path, each path as a sequence of its own. (A tree row
    attended whole under its 4-D mask moved SmolLM2's bf16 logprobs 0.0079 mean / 0.17 max nats,
    this model's 5e-4 max.) bf16 comes out bit for bit where the host's fp32 attention gives a query
    the same sums in a longer sequence (AVX2); fp32 within its rounding (the Linear layers' kernels
    differ with the number of rows)."""
    from tinkerd import hardware

    engine = TrainerEngine(wider_model_dir, zero_stage=0, dtype=dtype)
    assert engine.packable
    engine.create_model("m", LoraSpec(rank=8, seed=5))
    data = _rollouts(4, 8, seed=1)
    engine.forward_backward("m", data, "importance_sampling", {}, forward_only=False)
    engine.optim_step("m", ADAM)                               # a trained adapter: every LoRA delta non-zero
    packed, pack = [], prefix_tree.pack
    monkeypatch.setattr(prefix_tree, "pack", lambda *a, **k: packed.append(pack(*a, **k)) or packed[-1])
    in_tree = _rollout_logprobs(engine, data, packable=True)
    assert packed[-1] is not None and len(packed[-1].paths) > 1      # paths of several lengths
    alone = [_rollout_logprobs(engine, [d], packable=False)[0] for d in data]
    gap = max((got - want).abs().max().item() for got, want in zip(in_tree, alone))
    if dtype == "float32":
        assert gap <= 1e-5
    elif engine.device.type == "cpu" and not hardware.native_bf16(gpu=False) and _attention_alike_in_longer_sequences():
        assert gap == 0                           # AVX2: bf16 GEMMs widened to fp32 (fp32_gemm.py), attention alike
    else:     # 0 on AVX512-BF16 for this model, 0.0032 on an AVX-512 VM without bf16 (SmolLM2 moves, as padded)
        assert gap <= 1e-2                        # AMX and GPUs: not measured


def test_every_position_of_a_tree_is_owned_by_one_path():
    data = _rollouts(3, 5, seed=4) + _rollouts(1, 3, seed=4)[:1]      # a datum twice: one of the two is no leaf
    tokens = [list(d.tokens) for d in data]
    packed = prefix_tree.pack(tokens, torch.cat([d.loss_fn_inputs["target_tokens"] for d in data]))
    owners = torch.cat([g.dest for g in packed.paths])
    assert len(owners) == len(set(owners.tolist()))                 # no position owned twice
    datum_positions = set(packed.unembed[packed.expand].tolist())
    assert datum_positions <= set(owners.tolist())                   # every datum's positions owned
    for g in packed.paths:
        for row, nodes in zip(g.rows.tolist(), g.nodes.tolist()):
            attends = packed.mask[row, 0, nodes[-1]].nonzero().squeeze(1).tolist()
            assert attends == nodes                                  # a path: a leaf and its ancestors, in order
