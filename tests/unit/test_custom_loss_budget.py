"""A custom loss is admitted against whole-graph budgets before it runs (trainer_service/custom_loss.py
`_Cost`): the bytes alive at once (what autograd keeps included, float64 counted as 8 bytes) and
the forward FLOPs, each refused with a user error that names the budget. Values no later node
reads are dropped, in the real run too. Integer indices are bounds-checked before use. The
upload itself is parsed in bounded time however large it inflates (tinkerd/custom_loss.py)."""

from __future__ import annotations

import json
import time
import weakref

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from loss_examples import dpo_loss, ppo_loss
from tinkerd import custom_loss as spec_mod
from tinkerd.errors import UserError
from trainer_service import custom_loss as built_mod
from trainer_service.custom_loss import CompiledLoss


def _handmade(nodes: list[dict], inputs=(("logprobs", 1),), name: str = "handmade") -> CompiledLoss:
    """A graph as a client could send it without the SDK's tracer; its loss is the node `loss`."""
    output = {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "loss"}, {"dict": {}}]}], "kwargs": {}}
    placeholders = [{"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n, _ in inputs]
    graph = {"format": 1, "nodes": placeholders + nodes + [output]}
    return CompiledLoss(spec_mod.parse(name, [{"name": n, "rank": r} for n, r in inputs], graph))


def _fn(name, target, *args, **kwargs):
    return {"op": "call_function", "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def _method(name, target, *args):
    return {"op": "call_method", "name": name, "target": target, "args": list(args), "kwargs": {}}


def _ref(name):
    return {"ref": name}


def _summed(names: list[str]) -> list[dict]:
    """loss = logprobs.sum() + each named value's sum (all of them read only at the end)."""
    nodes = [_method(f"s_{n}", "sum", _ref(n)) for n in names]
    nodes.append(_method("acc0", "sum", _ref("logprobs")))
    for i, n in enumerate(names):
        nodes.append(_fn(f"acc{i + 1}", "operator.add", _ref(f"acc{i}"), _ref(f"s_{n}")))
    nodes.append(_fn("loss", "operator.mul", _ref(f"acc{len(names)}"), 1.0))
    return nodes


TABLE = (("logprobs", 1), ("table", 2))


def _cat_double_bomb(copies: int) -> CompiledLoss:
    """torch.cat([table.double()] * 8), `copies` times, each alive until the loss sums them all."""
    nodes = [_method("d", "double", _ref("table"))]
    nodes += [_fn(f"c{i}", "torch.cat", [_ref("d")] * 8) for i in range(copies)]
    return _handmade(nodes + _summed([f"c{i}" for i in range(copies)]), TABLE, "cat_double")


def test_the_cat_double_bomb_is_refused_by_the_memory_budget():
    """Measured before: 500 such nodes over an int64 [16, 6144] input took the trainer +2.8 GiB."""
    table = torch.zeros(16, 6144, dtype=torch.int64)
    with pytest.raises(UserError, match=r"cat_double.*at node c\d+ \(torch.cat\).*over the memory budget of "
                                        r"\d+ bytes per datum"):
        _cat_double_bomb(150).run([torch.zeros(16), table])


def test_values_no_node_reads_again_are_not_counted_and_not_kept():
    """The same cats, each read by nothing: one at a time is alive, in the tally and in the run."""
    nodes = [_method("d", "double", _ref("table"))]
    nodes += [_fn(f"c{i}", "torch.cat", [_ref("d")] * 8) for i in range(100)]
    nodes.append(_method("loss", "sum", _ref("logprobs")))
    built = _handmade(nodes, TABLE)
    table = torch.zeros(16, 6144, dtype=torch.int64)
    cost = built.check_cost([torch.zeros(16), table])
    one_cat = 8 * table.numel() * 8                    # float64
    assert cost.peak <= one_cat + table.numel() * 8, cost.peak
    assert built.run([torch.zeros(16), table])[0].item() == 0.0


def test_float64_counts_eight_bytes():
    def kept(dtype_method: str) -> int:
        nodes = [_method("d", dtype_method, _ref("table"))]
        nodes += [_fn(f"c{i}", "torch.cat", [_ref("d")] * 8) for i in range(4)]
        return _handmade(nodes + _summed([f"c{i}" for i in range(4)]), TABLE).check_cost(
            [torch.zeros(16), torch.zeros(16, 64, dtype=torch.int64)]).peak
    assert 1.9 < kept("double") / kept("float") <= 2.0


def test_a_chain_of_matmuls_is_refused_by_the_flop_budget():
    """reshape to [4096, 4096] (within 8x the input's elements) and multiply it by itself: each
    matmul 137 GFLOP, ~70 TFLOP in 500 nodes, where the shape check alone let it through."""
    nodes = [_fn("big", "torch.cat", [_ref("table")] * 8), _method("square", "reshape", _ref("big"), 4096, 4096)]
    previous = "square"
    for i in range(20):
        nodes.append(_fn(f"m{i}", "operator.matmul", _ref(previous), _ref("square")))
        previous = f"m{i}"
    nodes.append(_method("loss", "sum", _ref(previous)))
    built = _handmade(nodes, TABLE, "matmuls")
    table = torch.zeros(16, 131072)
    started = time.monotonic()
    with pytest.raises(UserError, match=r"'matmuls'.*at node m0 \(operator.matmul\).*over the FLOP budget"):
        built.run([torch.zeros(16), table])
    assert time.monotonic() - started < 5      # refused on meta tensors: nothing multiplied


def test_a_datums_inputs_past_the_element_budget_are_refused(monkeypatch):
    monkeypatch.setattr(built_mod, "MAX_INPUT_ELEMENTS", 1000)
    built = _handmade([_method("loss", "sum", _ref("logprobs"))], TABLE)
    with pytest.raises(UserError, match="1016 elements, over the input budget of 1000"):
        built.run([torch.zeros(8), torch.zeros(8, 126)])


def _traced(fn, ranks) -> CompiledLoss:
    handle = trace_loss(fn, ranks, "session")
    graph = encode_graph(handle).model_dump(mode="json")
    return CompiledLoss(spec_mod.parse(handle.name, [i.model_dump() for i in handle.inputs], graph))


@pytest.mark.parametrize("tokens", [1, 4096, 32768])
def test_ordinary_losses_are_admitted_with_room_to_spare(tokens):
    dpo = _traced(dpo_loss, {"logprobs": 1, "ref_logprobs": 1, "sign": 0})
    ppo = _traced(ppo_loss, {"logprobs": 1, "old_logprobs": 1, "advantages": 1})
    lp = -torch.rand(tokens, requires_grad=True)
    for built, args in ((dpo, [lp, -torch.rand(tokens), torch.tensor(1.0)]),
                        (ppo, [lp, -torch.rand(tokens), torch.randn(tokens)])):
        cost = built.check_cost(args)
        assert cost.peak <= cost.max_bytes / 8 and cost.flops <= cost.max_flops / 100, (cost.peak, cost.flops)
        loss, _ = built.run(args)
        assert torch.isfinite(loss)


def test_the_real_run_drops_what_no_later_node_reads(monkeypatch):
    """A chain of 50 products: each one's value is dropped once the next is made."""
    alive: list[weakref.ref] = []
    most = 0
    multiply = built_mod.FUNCTIONS["operator.mul"]

    def counting(a, b):
        nonlocal most
        most = max(most, sum(r() is not None for r in alive))
        out = multiply(a, b)
        if isinstance(out, torch.Tensor):
            alive.append(weakref.ref(out))
        return out
    monkeypatch.setitem(built_mod.FUNCTIONS, "operator.mul", counting)
    nodes = [_fn("x0", "operator.mul", _ref("table"), 2.0)]
    nodes += [_fn(f"x{i}", "operator.mul", _ref(f"x{i - 1}"), 1.0) for i in range(1, 50)]
    nodes += [_method("s", "sum", _ref("x49")), _method("lps", "sum", _ref("logprobs")),
              _fn("loss", "operator.add", _ref("lps"), _ref("s"))]
    built = _handmade(nodes, TABLE)
    loss, _ = built.run([torch.zeros(4), torch.ones(4, 3)])
    assert loss.item() == 24.0
    assert most <= 2, most          # before: all 50 alive until the loss returned


def _index_loss(index_nodes: list[dict]) -> CompiledLoss:
    return _handmade(index_nodes + [_method("loss", "sum", _ref("picked"))],
                     (("logprobs", 1), ("table", 2), ("idx", 2)))


@pytest.mark.parametrize("how", ["gather", "getitem", "getitem_after_ellipsis"])
def test_integer_indices_out_of_range_are_refused_before_use(how):
    if how == "gather":
        nodes = [_fn("picked", "torch.gather", _ref("table"), 1, _ref("idx"))]
    elif how == "getitem":
        nodes = [_fn("picked", "operator.getitem", _ref("logprobs"), _ref("idx"))]
    else:
        nodes = [_fn("picked", "operator.getitem", _ref("table"), {"tuple": [{"ellipsis": True}, _ref("flat")]}),
                 ]
        nodes.insert(0, _method("flat", "flatten", _ref("idx")))
    built = _index_loss(nodes)
    table = torch.arange(12.0).reshape(4, 3)
    good = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])
    assert torch.isfinite(built.run([-torch.rand(4), table, good])[0])
    bad = good.clone()
    bad[2, 1] = 7
    with pytest.raises(UserError, match=r"node picked \((torch.gather|operator.getitem)\) indexes dim \d of size \d "
                                        r"with 7: an index must be in"):
        built.run([-torch.rand(4), table, bad])
    bad[2, 1] = -5
    with pytest.raises(UserError, match="with -5: an index must be in"):
        built.run([-torch.rand(4), table, bad])


def test_a_negative_index_in_range_still_works():
    built = _index_loss([_fn("picked", "operator.getitem", _ref("logprobs"), _ref("idx"))])
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    loss, _ = built.run([lp, torch.zeros(4, 1), torch.tensor([[-1], [-4], [0], [3]])])
    assert loss.item() == -4.0 - 1.0 - 1.0 - 4.0


def _bomb_graph(nodes: int = 500, rows: int = 28, cols: int = 1024) -> dict:
    """What a ~3 KiB zstd body inflates to: 500 nodes each with a 28 x 1024 constant (~29 MiB of JSON)."""
    const = [[0] * cols for _ in range(rows)]          # one object: building it is cheap, walking it is not
    calls = [_fn(f"n{i}", "torch.tensor", const) for i in range(nodes)]
    calls.append(_method("loss", "sum", _ref("logprobs")))
    output = {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "loss"}, {"dict": {}}]}], "kwargs": {}}
    return {"format": 1, "nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [],
                                    "kwargs": {}}, *calls, output]}


def test_parsing_stops_once_the_graph_passes_its_size():
    """Measured before: parse walked all of it, ~30 s for this graph, before refusing its size."""
    started = time.monotonic()
    with pytest.raises(UserError, match=f"over {spec_mod.MAX_GRAPH_BYTES} bytes as JSON"):
        spec_mod.parse("bomb", [{"name": "logprobs", "rank": 1}], _bomb_graph())
    assert time.monotonic() - started < 2.0


def test_a_graph_just_within_the_size_is_still_accepted():
    """The running count is a lower bound of the canonical JSON: no graph that fits is refused early."""
    inputs = [{"name": "logprobs", "rank": 1}]

    def canonical(nodes: int) -> str:
        return json.dumps({"name": "fits", "inputs": inputs, "graph": _bomb_graph(nodes=nodes, rows=1, cols=1000)},
                          sort_keys=True, separators=(",", ":"))
    largest = next(n for n in range(1, 512) if len(canonical(n + 1)) > spec_mod.MAX_GRAPH_BYTES)
    assert spec_mod.parse("fits", inputs, _bomb_graph(nodes=largest, rows=1, cols=1000)).canonical == canonical(largest)
    with pytest.raises(UserError, match="bytes as JSON"):
        spec_mod.parse("fits", inputs, _bomb_graph(nodes=largest + 1, rows=1, cols=1000))


def test_values_read_through_keywords_dicts_and_tuples_live_until_their_last_reader():
    nodes = [_method("a", "exp", _ref("logprobs")), _method("b", "neg", _ref("logprobs")),
             _method("c", "abs", _ref("logprobs")),
             _fn("clamped", "torch.clamp", _ref("logprobs"), max=_ref("a")),             # a keyword
             _fn("both", "torch.stack", {"tuple": [_ref("b"), _ref("clamped")]}),           # a tuple
             _fn("picked", "operator.getitem", {"dict": {"ref": _ref("c")}}, "ref"),      # a dict keyed "ref"
             _method("s", "sum", _ref("both")), _method("t", "sum", _ref("picked")),
             _fn("loss", "operator.add", _ref("s"), _ref("t"))]
    lp = torch.tensor([-1.0, -2.0])
    loss, _ = _handmade(nodes).run([lp])
    assert loss.item() == pytest.approx((1 + 2) + (-1 - 2) + (1 + 2))
