"""Server-side custom losses: the graph the SDK uploads, checked (tinkerd/custom_loss.py) and built
from the trainer's op table (trainer_service/custom_loss.py), gives the loss, metrics and
gradient the SDK's own torch.fx module gives; what it cannot run safely is a user error."""

import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from tinkerd import custom_loss as spec_mod
from tinkerd.errors import UserError
from trainer_service import custom_loss as built_mod
from trainer_service.custom_loss import CompiledLoss, Losses


def dpo_loss(logprobs, ref_logprobs, sign):
    margin = sign * (logprobs.sum() - ref_logprobs.sum())
    loss = -F.logsigmoid(0.1 * margin)
    return loss, {"custom/margin:mean": margin.detach(), "custom/dpo:sum": loss}


def ppo_loss(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum() / logprobs.shape[0]
    clipfrac = ((ratio - clipped).abs() > 0).float().mean()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/clipfrac:mean": clipfrac}


def kitchen_sink(logprobs, weights, mask):
    """Methods, keywords, slices, softmax, where, stack, full_like."""
    w = torch.where(mask > 0, weights, torch.zeros_like(weights))
    soft = torch.log_softmax(torch.stack([logprobs, w], dim=0), dim=0)[0, 1:]
    scale = torch.full_like(logprobs, 0.5).sum()
    total = -(soft * w[1:]).sum(dim=-1, keepdim=False) * scale + logprobs.clamp(max=0.0).mean()
    return total, {"custom/soft:sum": soft.sum()}


CASES = [
    (dpo_loss, {"logprobs": 1, "ref_logprobs": 1, "sign": 0}, lambda t: [torch.randn(t), torch.tensor(-1.0)]),
    (ppo_loss, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}, lambda t: [torch.randn(t), torch.randn(t)]),
    (kitchen_sink, {"logprobs": 1, "weights": 1, "mask": 1},
     lambda t: [torch.rand(t), (torch.arange(t) % 2).float()]),
]


def _spec(fn, ranks) -> tuple:
    handle = trace_loss(fn, ranks, "session")
    graph = encode_graph(handle).model_dump(mode="json")
    return handle, spec_mod.parse(handle.name, [i.model_dump() for i in handle.inputs], graph)


@pytest.mark.parametrize("fn, ranks, make", CASES, ids=[c[0].__name__ for c in CASES])
def test_the_built_loss_matches_the_sdks_traced_module(fn, ranks, make):
    handle, spec = _spec(fn, ranks)
    built = CompiledLoss(spec_mod.from_canonical(spec.canonical))     # what the trainer builds from the wire
    torch.manual_seed(0)
    for length in (1, 5, 9):
        logprobs, inputs = -torch.rand(length), make(length)
        theirs_lp, ours_lp = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
        theirs, theirs_metrics = handle.graph(theirs_lp, *inputs)
        ours, our_metrics = built.run([ours_lp, *inputs])
        theirs.backward()
        ours.backward()
        assert torch.equal(ours.detach(), theirs.detach())
        assert (ours_lp.grad - theirs_lp.grad).abs().max() <= 1e-6
        assert ({k: float(v.detach()) for k, v in our_metrics.items()}
                == {k: float(v.detach()) for k, v in theirs_metrics.items()})
    assert sorted(built.metric_keys) == sorted(theirs_metrics)


def test_every_allowed_op_has_an_implementation():
    assert set(spec_mod.FUNCTIONS) == set(built_mod.FUNCTIONS)
    assert set(spec_mod.METHODS) == set(built_mod.METHODS)


def test_the_canonical_form_is_stable():
    _, spec = _spec(ppo_loss, CASES[1][1])
    again = spec_mod.from_canonical(spec.canonical)
    assert (again.canonical, again.digest, again.input_names) == (spec.canonical, spec.digest,
                                                                   ("old_logprobs", "advantages"))


def _built(fn, ranks) -> CompiledLoss:
    return CompiledLoss(_spec(fn, ranks)[1])


def test_a_shape_mismatch_only_a_datum_shows_is_a_user_error_naming_the_node():
    def bad(logprobs, weights):
        return (logprobs[1:] * weights).sum(), {}    # [T - 1] * [T]: not known until it runs
    built = _built(bad, {"logprobs": 1, "weights": 1})
    with pytest.raises(UserError, match=r"node mul \(operator.mul\) failed"):
        built.run([torch.zeros(4), torch.zeros(4)])


def test_an_intermediate_past_the_size_cap_is_refused_before_it_is_made():
    def outer(logprobs):
        return (logprobs.unsqueeze(0) * logprobs.unsqueeze(1)).sum(), {}     # T^2 elements
    built = _built(outer, {"logprobs": 1})
    built.run([torch.zeros(8)])                        # small: within the slack
    with pytest.raises(UserError, match=r"node mul .* shape \[4096, 4096\].*at most"):
        built.run([torch.zeros(4096)])


def test_python_integer_blowups_are_refused():
    def power(logprobs):
        n = logprobs.shape[0] ** 1000000
        return logprobs.sum() * n, {}
    with pytest.raises(UserError, match="exponent 1000000"):
        _built(power, {"logprobs": 1}).run([torch.zeros(3)])


def test_a_loss_that_is_not_a_scalar_is_refused():
    def per_token(logprobs):
        return -logprobs[1:], {}                     # a slice: its shape is not inferred at create
    with pytest.raises(UserError, match="scalar loss"):
        _built(per_token, {"logprobs": 1}).run([torch.zeros(3)])


def test_missing_or_wrong_rank_inputs_name_the_key():
    built = _built(ppo_loss, CASES[1][1])
    with pytest.raises(UserError, match="no 'advantages'"):
        built.check_datum(0, {"old_logprobs": torch.zeros(3)}, 3)
    with pytest.raises(UserError, match=r"'advantages'\] has rank 2"):
        built.check_datum(0, {"old_logprobs": torch.zeros(3), "advantages": torch.zeros(3, 2)}, 3)


def test_built_once_per_model_and_loss():
    _, spec = _spec(ppo_loss, CASES[1][1])
    losses = Losses(capacity=2)
    first = losses.get("m1", "s:loss:0", spec.canonical)
    assert losses.get("m1", "s:loss:0", spec.canonical) is first and losses.builds == 1
    losses.get("m2", "s:loss:0", spec.canonical)
    losses.get("m3", "s:loss:0", spec.canonical)
    assert losses.builds == 3 and losses.get("m1", "s:loss:0", spec.canonical) is not first   # evicted (LRU)
    with pytest.raises(UserError, match="create_custom_loss"):
        losses.get("m1", "", "")
    with pytest.raises(UserError, match="not allowed"):
        losses.get("m1", "s:loss:1", spec.canonical.replace('"torch.exp"', '"torch.load"'))


def _handmade(nodes: list[dict], inputs=(("logprobs", 1),)) -> CompiledLoss:
    """A graph as a client could send it without the SDK's tracer."""
    output = {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "loss"}, {"dict": {}}]}], "kwargs": {}}
    placeholders = [{"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n, _ in inputs]
    graph = {"format": 1, "nodes": placeholders + nodes + [output]}
    return CompiledLoss(spec_mod.parse("handmade", [{"name": n, "rank": r} for n, r in inputs], graph))


def _call(name, target, *args):
    return {"op": "call_function", "name": name, "target": target, "args": list(args), "kwargs": {}}


def test_sequence_blowups_are_refused():
    doubling = [_call("x0", "operator.mul", {"tuple": [1, 2]}, 1)]
    doubling += [_call(f"x{i}", "operator.add", {"ref": f"x{i - 1}"}, {"ref": f"x{i - 1}"}) for i in range(1, 40)]
    doubling.append(_call("loss", "torch.sum", {"ref": "logprobs"}))
    with pytest.raises(UserError, match=r"node x10: operator.add would make a sequence of 2048 items"):
        _handmade(doubling).run([torch.zeros(3)])
    repeat = [_call("big", "operator.mul", {"tuple": [0]}, 2**40), _call("loss", "torch.sum", {"ref": "logprobs"})]
    with pytest.raises(UserError, match="sequence of 1099511627776 items"):
        _handmade(repeat).run([torch.zeros(3)])
    text = [_call("big", "operator.mul", "ab", 2**40), _call("loss", "torch.sum", {"ref": "logprobs"})]
    with pytest.raises(UserError, match="operator.mul of a string"):
        _handmade(text).run([torch.zeros(3)])


def test_shape_mismatches_and_non_scalar_losses_are_refused_when_created():
    def mismatch(logprobs, table):
        return (logprobs * table).sum(), {}          # [T] * [T, K]: T against K
    with pytest.raises(UserError, match=r"node mul \(operator.mul\): shapes \[T\] and \[T, K\] do not broadcast"):
        _spec(mismatch, {"logprobs": 1, "table": 2})

    def per_token(logprobs, weights):
        return -(logprobs * weights), {}
    with pytest.raises(UserError, match=r"returns a loss of shape \[T\]; it must be a scalar"):
        _spec(per_token, {"logprobs": 1, "weights": 1})

    def vector_metric(logprobs):
        return -logprobs.sum(), {"custom/lp:sum": logprobs}
    with pytest.raises(UserError, match=r"metric 'custom/lp:sum' has shape \[T\]"):
        _spec(vector_metric, {"logprobs": 1})

    def bad_dim(logprobs):
        return logprobs.sum(dim=1), {}
    with pytest.raises(UserError, match=r"dim 1 is out of range for shape \[T\]"):
        _spec(bad_dim, {"logprobs": 1})

    def fine(logprobs, table, scale):                # broadcasts right: [T, K] * [T, 1] * []
        weighted = table * logprobs.unsqueeze(-1) * scale
        return weighted.sum(dim=-1).mean() / logprobs.shape[0], {"custom/k:mean": table.sum(1, keepdim=True).mean()}
    _spec(fine, {"logprobs": 1, "table": 2, "scale": 0})
