"""A server-side custom loss on a real DeepSpeed engine gives what the SDK's client-side
forward_backward_custom gives (a forward, the loss and its gradient on the client, then a
cross_entropy backward with weights -dloss/dlogprobs): the same losses, metrics, outputs and,
after an optimizer step, the same adapter (fp32, within 1e-5)."""

import pytest
import torch
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from tinker.lib.public_interfaces.training_client import TrainingClient

from tinkerd import custom_loss as spec_mod
from tinkerd.errors import UserError
from trainer_service.engine import AdamParams, DatumInput, TrainerEngine
from trainer_service.lora import LoraSpec
from loss_examples import dpo_loss, ppo_loss


SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33]]


def _inputs(name: str, i: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    if name == "dpo_loss":
        return {"ref_logprobs": -torch.rand(n, generator=g) * 5, "sign": torch.tensor([1.0 if i % 2 == 0 else -1.0])}
    return {"old_logprobs": -torch.rand(n, generator=g) * 5, "advantages": torch.randn(n, generator=g)}


def _sdk_datum(tokens, inputs) -> types.Datum:
    loss_fn_inputs = {"target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:]))}
    for key, value in inputs.items():
        loss_fn_inputs[key] = (types.TensorData(data=value.tolist(), dtype="float32", shape=[])
                               if key == "sign" else types.TensorData.from_torch(value))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_fn_inputs)


ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


@pytest.mark.parametrize("fn, ranks", [
    (dpo_loss, {"logprobs": 1, "ref_logprobs": 1, "sign": 0}),
    (ppo_loss, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}),
], ids=["dpo", "ppo"])
def test_server_side_equals_client_side(tiny_model_dir, fn, ranks):
    handle = trace_loss(fn, ranks, "s")
    spec = spec_mod.parse(handle.name, [i.model_dump() for i in handle.inputs],
                          encode_graph(handle).model_dump(mode="json"))
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    for model_id in ("server", "client"):
        engine.create_model(model_id, LoraSpec(rank=4, seed=3))
    initial, _ = engine.export_adapter("server")
    inputs = [_inputs(fn.__name__, i, len(s) - 1) for i, s in enumerate(SEQUENCES)]
    data = [DatumInput(s[:-1], {"target_tokens": torch.tensor(s[1:]), **x}) for s, x in zip(SEQUENCES, inputs)]

    # Server side: one call.
    outputs, metrics = engine.forward_backward("server", data, "custom", {}, forward_only=False,
                                               custom_loss=("s:loss:0", spec.canonical))
    assert engine.custom_losses.builds == 1

    # Client side, as the SDK does it: forward, the loss and its gradient, a weighted cross_entropy.
    sdk_data = [_sdk_datum(s, x) for s, x in zip(SEQUENCES, inputs)]
    forward = [DatumInput(d.tokens, {"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in data]
    fwd_outputs, _ = engine.forward_backward("client", forward, "cross_entropy", {}, forward_only=True)
    fwd = types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={}, loss_fn_outputs=[
        {"logprobs": types.TensorData.from_torch(o["logprobs"])} for o in fwd_outputs])
    client = TrainingClient._compute_custom_loss(sdk_data, handle, fwd)
    backward = [DatumInput(d.tokens, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                      "weights": c.loss_fn_inputs["weights"].to_torch()})
                for d, c in zip(data, client.data)]
    bwd_outputs, bwd_metrics = engine.forward_backward("client", backward, "cross_entropy", {}, forward_only=False)

    assert metrics["loss:sum"] == pytest.approx(client.loss_sum, abs=1e-5)
    assert metrics["surrogate_loss:sum"] == pytest.approx(bwd_metrics["loss:sum"], abs=1e-5)
    for key, value in client.metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key
    for ours, theirs in zip(outputs, bwd_outputs):
        assert torch.allclose(ours["logprobs"], theirs["logprobs"], atol=1e-6)
        assert torch.allclose(ours["elementwise_loss"], theirs["elementwise_loss"], atol=1e-6)

    engine.optim_step("server", ADAM)
    engine.optim_step("client", ADAM)
    server, _ = engine.export_adapter("server")
    client_adapter, _ = engine.export_adapter("client")
    assert max((server[k] - client_adapter[k]).abs().max().item() for k in server) <= 1e-5
    assert max((server[k] - initial[k]).abs().max().item() for k in server) > 1e-4     # it did train
    assert engine.custom_losses.builds == 1


def test_bad_custom_inputs_are_user_errors(tiny_model_dir):
    handle = trace_loss(ppo_loss, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}, "s")
    spec = spec_mod.parse(handle.name, [i.model_dump() for i in handle.inputs],
                          encode_graph(handle).model_dump(mode="json"))
    engine = TrainerEngine(tiny_model_dir, zero_stage=2)
    engine.create_model("m", LoraSpec(rank=2, seed=0))
    datum = DatumInput([5, 6, 7], {"target_tokens": torch.tensor([6, 7, 8]), "old_logprobs": torch.zeros(3)})
    with pytest.raises(UserError, match="no 'advantages'"):
        engine.forward_backward("m", [datum], "custom", {}, forward_only=True, custom_loss=("l", spec.canonical))
    with pytest.raises(UserError, match="create_custom_loss"):
        engine.forward_backward("m", [datum], "custom", {}, forward_only=True)
