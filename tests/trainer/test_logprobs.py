"""The trainer's token logprobs without the batch's full logits (trainer_service/logprobs.py):
only real positions unembedded, in chunks recomputed in the backward past --max-logits-mib.
The same logprobs, position by position, as the CausalLM's own logits give; the same training."""

import pytest
import torch

from trainer_service import logprobs
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec


def _datum(tokens):
    return DatumInput(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]),
                                    "weights": torch.linspace(0.5, 1.5, len(tokens) - 1)})


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [_datum(torch.randint(0, 1000, (n + 1,), generator=gen).tolist()) for n in lengths]


ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


def _train(engine, model_id, batches, forward_only=False):
    """Each batch's logprobs, then the adapter after a step on each."""
    seen = []
    for data in batches:
        outputs, metrics = engine.forward_backward(model_id, data, "cross_entropy", {}, forward_only=forward_only)
        seen.append(([o["logprobs"] for o in outputs], metrics["loss:sum"]))
        if not forward_only:
            engine.optim_step(model_id, ADAM)
    return seen, engine.export_adapter(model_id)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_chunked_and_unpadded_logprobs_equal_the_full_logits_and_train_alike(tiny_model_dir, monkeypatch, stage):
    # Padded (uneven lengths) and unpadded batches; 1 MiB holds 256 positions of the tiny model's
    # 1,024-token vocabulary, so the 300+ positions below go in chunks.
    batches = [_batch([90, 64, 120, 33]), _batch([80, 80, 80, 80], seed=1), _batch([7, 150, 150], seed=2)]
    chunked = TrainerEngine(tiny_model_dir, zero_stage=stage, max_logits_mib=1)
    unembedded, unembed = [], logprobs._lp       # counted from here (not the start-up's probe, microbatches.py)
    monkeypatch.setattr(logprobs, "_lp", lambda head, rows, targets: unembedded.append(len(rows)) or
                        unembed(head, rows, targets))
    chunked.create_model("m", LoraSpec(rank=8, seed=0))
    got, got_adapter = _train(chunked, "m", batches)
    del chunked
    # The first batch's 307 real positions of 4 x 120: two chunks, no padding (then, at stage 2,
    # the same two again in the backward).
    assert unembedded[:2] == [256, 51] and max(unembedded) == 256
    assert len(unembedded) == (12 if stage == 2 else 6)
    monkeypatch.setattr(logprobs, "_lp", unembed)

    monkeypatch.setattr(logprobs, "PLAIN_HEADS", frozenset())      # the CausalLM's own logits, as before
    full = TrainerEngine(tiny_model_dir, zero_stage=stage)
    full.create_model("m", LoraSpec(rank=8, seed=0))
    want, want_adapter = _train(full, "m", batches)

    first = True
    for (got_lps, got_loss), (want_lps, want_loss) in zip(got, want):
        if first:       # same weights: the same values, position by position
            assert all(torch.equal(g, w) for g, w in zip(got_lps, want_lps))
            assert got_loss == want_loss
        else:           # after steps whose gradients summed the chunks in another order
            assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got_lps, want_lps))
        first = False
    for key in want_adapter:
        assert torch.allclose(got_adapter[key], want_adapter[key], atol=1e-6), key


def test_forward_only_through_chunks_equals_the_full_logits(tiny_model_dir, monkeypatch):
    data = _batch([300, 41])
    chunked = TrainerEngine(tiny_model_dir, zero_stage=2, max_logits_mib=1)
    chunked.create_model("m", LoraSpec(rank=4, seed=3))
    got, _ = _train(chunked, "m", [data], forward_only=True)
    monkeypatch.setattr(logprobs, "PLAIN_HEADS", frozenset())
    want, _ = _train(chunked, "m", [data], forward_only=True)
    assert all(torch.equal(g, w) for g, w in zip(got[0][0], want[0][0]))
    assert all(float(lp.max()) < 0 for lp in got[0][0])


def test_the_setting_s_default_is_the_engine_s():
    import inspect

    from trainer_service.settings import TrainerSettings
    from tinkerd import settings

    field = next(f for f in settings.fields(TrainerSettings) if f.name == "max_logits_mib")
    assert settings.default_of(field) == inspect.signature(TrainerEngine).parameters["max_logits_mib"].default == 0


def test_the_default_logits_budget_is_1_gib_on_a_cpu_and_a_share_of_the_activations_on_a_gpu():
    gib = 1 << 30
    assert logprobs.default_logits_bytes("cpu", 100 * gib) == gib
    # A whole H200 (a quarter of 141 GB for activations): Llama 3 1B's 8x512 logits (2.1 GB) whole.
    assert logprobs.default_logits_bytes("cuda", 35 * gib) == 35 * gib // 8
    assert logprobs.default_logits_bytes("cuda", 35 * gib) > 8 * 512 * 128256 * 4
    assert logprobs.default_logits_bytes("cuda", 4 * gib) == gib       # a small card: never below the CPU's


def test_an_engine_on_the_default_takes_its_device_s_budget(tiny_model_dir):
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    assert engine.max_logits_bytes == logprobs.default_logits_bytes(engine.device.type, engine.activation_budget)
    assert TrainerEngine(tiny_model_dir, zero_stage=2, max_logits_mib=3).max_logits_bytes == 3 << 20
