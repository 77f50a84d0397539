"""Server-side custom losses: a checked graph (tinkerd/custom_loss.py) built into an interpreter
over a fixed table of torch callables, and run per datum inside forward_backward (training.py).

Nothing of the client's is run as code: each node's name picks an entry of FUNCTIONS or METHODS
below, its arguments are earlier nodes' values or constants. Before a datum runs for real, the
graph runs once on meta tensors of the datum's shapes (no memory, no compute): a shape mismatch
is the caller's error, named with its node, and no intermediate may hold more than GROWTH times
the largest input (a broadcast of [T, 1] by [1, T] would ask for T^2). The same run admits the
whole graph against budgets (`_Cost`): the bytes alive at once, what autograd keeps for the
backward included, and the FLOPs, each a user error naming the budget and the node that passed
it. The meta run is cached per input shapes.

A value is dropped once no later node reads it, in the real run as in the meta run. Integer
indices (getitem, gather) are bounds-checked before they are used: on a GPU an index out of range
is a device-side assert that would break the trainer for every tenant, not an error of one call.

Built once per (model, loss id, spec digest) and kept in a small LRU (`Losses`).
"""

from __future__ import annotations

import collections
import hashlib
import operator
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tinkerd import custom_loss as spec_mod
from tinkerd.errors import UserError

_DTYPES = {name: getattr(torch, name) for name in spec_mod.DTYPES}     # the ones a spec may name
_OPERATORS = {name: getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lt", "le", "gt", "ge", "eq", "ne", "and_",
    "or_", "xor", "getitem", "neg", "pos", "abs", "invert")}


def _getattr(value, name):
    return getattr(value, name)      # name is one of spec_mod.ATTRIBUTES (checked)


FUNCTIONS: dict[str, Callable] = {
    **{f"operator.{name}": fn for name, fn in _OPERATORS.items()},
    "getattr": _getattr,
    **{f"torch.{name}": getattr(torch, name) for name in (
        "exp", "log", "log1p", "expm1", "sigmoid", "tanh", "sqrt", "rsqrt", "abs", "neg", "sign", "square",
        "reciprocal", "relu", "isfinite", "logical_not", "minimum", "maximum", "logical_and", "logical_or",
        "clamp_min", "clamp_max", "unsqueeze", "logaddexp", "pow", "clamp", "clip", "where", "sum", "mean", "amax",
        "amin", "max", "min", "logsumexp", "softmax", "log_softmax", "squeeze", "cumsum", "gather", "stack", "cat",
        "ones_like", "zeros_like", "full_like", "tensor")},
    "torch.nn.functional.softmax": F.softmax, "torch.nn.functional.log_softmax": F.log_softmax,
    "torch._C._nn.log_sigmoid": F.logsigmoid, "torch._C._nn.softplus": F.softplus,
}
METHODS: dict[str, Callable] = {name: getattr(torch.Tensor, name) for name in spec_mod.METHODS}

# An intermediate may hold this many times the largest input's elements (plus a little, for
# scalars built from scalars); more is refused before anything is allocated.
GROWTH = 8
SLACK = 4096
# A datum's inputs, in elements (the gateway's request budget is below this by default).
MAX_INPUT_ELEMENTS = 1 << 24
# The bytes one datum's loss may hold at once, its backward's included: LIVE_GROWTH times its
# inputs' bytes, at least LIVE_FLOOR and at most LIVE_CEILING.
LIVE_GROWTH = 16
LIVE_FLOOR = 64 << 20
LIVE_CEILING = 1 << 30
# Its forward FLOPs: FLOPS_PER_ELEMENT per input element (a graph of MAX_NODES elementwise ops,
# each GROWTH times the inputs, is half that), plus FLOP_FLOOR.
FLOPS_PER_ELEMENT = 8192
FLOP_FLOOR = 1 << 26


class CompiledLoss:
    """One custom loss, built: `run(logprobs, inputs)` -> (scalar loss, {metric: scalar tensor})."""

    def __init__(self, spec: spec_mod.LossSpec):
        missing = [n.target for n in spec.nodes if n.op == "call_function" and n.target not in FUNCTIONS]
        missing += [n.target for n in spec.nodes if n.op == "call_method" and n.target not in METHODS]
        if missing:      # the two tables disagree: a server bug, caught by tests/unit/test_custom_loss_graphs.py
            raise RuntimeError(f"custom loss ops without an implementation: {missing}")
        self.spec = spec
        self.name = spec.name
        self.metric_keys = spec.metric_keys
        self._reads = [_refs([*node.args, *node.kwargs.values()]) for node in spec.nodes]
        self._frees = _last_reads(spec.nodes, self._reads)
        self._checked_shapes: set[tuple] = set()

    def check_datum(self, i: int, inputs: dict[str, torch.Tensor], n_tokens: int) -> None:
        """Each input the loss reads is present, at its declared rank ([T] and [T, K] have T = the
        datum's tokens); logprobs are the target tokens'."""
        for name, rank in self.spec.inputs[1:]:
            value = inputs.get(name)
            if value is None:
                raise UserError(f"datum {i}: loss_fn_inputs has no {name!r}, which custom loss {self.name!r} "
                                f"reads (got {sorted(inputs)})")
            if value.dim() != max(rank, 1):     # a scalar comes as a 1-element tensor
                raise UserError(f"datum {i}: loss_fn_inputs[{name!r}] has rank {value.dim()}, but custom loss "
                                f"{self.name!r} declared it with rank {rank}")
            if rank == 0 and value.numel() != 1:
                raise UserError(f"datum {i}: loss_fn_inputs[{name!r}] holds {value.numel()} values; custom "
                                f"loss {self.name!r} declared it a scalar (rank 0)")

    def arguments(self, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The graph's inputs in order: rank-0 inputs as 0-d tensors, as the client's to_torch gives them."""
        args = [logprobs]
        for name, rank in self.spec.inputs[1:]:
            value = inputs[name]
            args.append(value.reshape(()) if rank == 0 else value)
        return args

    def run(self, args: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shapes = tuple((tuple(a.shape), a.dtype) for a in args)
        if shapes not in self._checked_shapes:
            self.check_cost(args)
            if len(self._checked_shapes) > 4096:
                self._checked_shapes.clear()
            self._checked_shapes.add(shapes)
        return self._evaluate(args, None)

    def check_cost(self, args: list[torch.Tensor]) -> "_Cost":
        """The graph run on meta tensors of `args`' shapes and dtypes, logprobs requiring grad as
        in training: a user error if it fails or passes a budget. Returns what it costs."""
        elements = sum(a.numel() for a in args)
        if elements > MAX_INPUT_ELEMENTS:
            raise UserError(f"custom loss {self.name!r}: a datum's inputs hold {elements} elements, over the input "
                            f"budget of {MAX_INPUT_ELEMENTS} elements per datum")
        meta = [torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args]
        meta[0].requires_grad_(meta[0].is_floating_point())
        cost = _Cost(self.name, args)
        with torch.enable_grad():
            self._evaluate(meta, cost)
        cost.finish()
        return cost

    def _evaluate(self, args: list[torch.Tensor], cost: "_Cost | None"):
        values: dict[str, Any] = {}
        for i, node in enumerate(self.spec.nodes):
            if node.op == "placeholder":
                values[node.name] = args[i]
                continue
            if node.op == "output":
                return self._result(self._value(node.args[0], values))
            call_args = [self._value(a, values) for a in node.args]
            call_kwargs = {k: self._value(v, values) for k, v in node.kwargs.items()}
            fn = FUNCTIONS[node.target] if node.op == "call_function" else METHODS[node.target]
            _guard_python_values(node, call_args)
            if node.target in _INDEXING:
                _check_indices(self.name, node, call_args)
            if node.target == "torch.tensor":      # a constant, made where the inputs are
                call_kwargs["device"] = args[0].device
            try:
                out = fn(*call_args, **call_kwargs)
            except Exception as e:  # noqa: BLE001 - any failure of the user's graph is theirs to fix
                raise UserError(f"custom loss {self.name!r}: node {node.name} ({node.target}) failed: "
                                f"{type(e).__name__}: {str(e)[:300]}") from None
            _check_size(self.name, node, out, cost.max_elements if cost else None)
            values[node.name] = out
            if cost is not None:
                cost.add(node, call_args, out, self._reads[i], self._frees[i])
            for name in self._frees[i]:     # no later node reads it
                del values[name]
        raise UserError(f"custom loss {self.name!r} has no output node")

    def _value(self, arg: Any, values: dict[str, Any]) -> Any:
        if isinstance(arg, list):
            return [self._value(a, values) for a in arg]
        if not isinstance(arg, dict):
            return arg
        (kind, inner), = arg.items()
        if kind == "ref":
            return values[inner]
        if kind == "tuple":
            return tuple(self._value(a, values) for a in inner)
        if kind == "dict":
            return {k: self._value(v, values) for k, v in inner.items()}
        if kind == "slice":
            return slice(*(self._value(a, values) for a in inner))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "float":
            return float(inner)
        if kind == "dtype":
            return _DTYPES[inner]
        raise UserError(f"custom loss {self.name!r}: unknown argument kind {kind!r}")

    def _result(self, out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"custom loss {self.name!r} must return a scalar loss, got {shape}")
        if not loss.is_floating_point():
            raise UserError(f"custom loss {self.name!r} returned a {loss.dtype} loss; it must be floating point")
        for key, value in metrics.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise UserError(f"custom loss {self.name!r}: metric {key!r} must be a scalar tensor")
        return loss, metrics


def _guard_python_values(node, args: list) -> None:
    """Operators on Python values are Python's: exact integers (`n ** huge` would take the CPU for
    good) and sequence repetition and concatenation (`[1] * 2**40`, or `x + x` doubling node after
    node, would take the memory). Powers of integers keep small exponents; operators on strings are
    refused, and no list or tuple an operator makes may exceed spec_mod.MAX_CONSTANT_ITEMS."""
    if node.op != "call_function" or not node.target.startswith("operator.") or node.target == "operator.getitem":
        return
    if any(isinstance(a, str) for a in args):
        raise UserError(f"node {node.name}: {node.target} of a string")
    if node.target == "operator.pow" and len(args) == 2 and all(
            isinstance(a, int) and not isinstance(a, bool) for a in args) and abs(args[1]) > 64:
        raise UserError(f"node {node.name}: integer power with exponent {args[1]} (at most 64)")
    sequences = [a for a in args if isinstance(a, (list, tuple))]      # torch.Size is a tuple
    if sequences:
        counts = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        items = sum(len(a) for a in sequences) * max([1, *(abs(c) for c in counts)])
        if items > spec_mod.MAX_CONSTANT_ITEMS:
            raise UserError(f"node {node.name}: {node.target} would make a sequence of {items} items; at most "
                            f"{spec_mod.MAX_CONSTANT_ITEMS}")


def _refs(arg: Any) -> set[str]:
    """The node names an encoded argument reads (tinkerd/custom_loss.py `_arg`'s encoding)."""
    if isinstance(arg, list):
        return set().union(*map(_refs, arg))
    if not isinstance(arg, dict) or len(arg) != 1:
        return set()
    (kind, inner), = arg.items()
    if kind == "ref":
        return {inner}
    if kind in ("tuple", "slice"):
        return set().union(*map(_refs, inner))
    if kind == "dict":
        return set().union(*map(_refs, inner.values()))
    return set()


def _last_reads(nodes, reads: list[set[str]]) -> list[tuple[str, ...]]:
    """For each node, the values it is the last to read, its own if none reads it (the output
    node frees none: it returns them)."""
    last = {node.name: i for i, node in enumerate(nodes)}
    for i, names in enumerate(reads):
        for name in names:
            last[name] = i
    frees: list[list[str]] = [[] for _ in nodes]
    for name, i in last.items():
        if nodes[i].op != "output":
            frees[i].append(name)
    return [tuple(sorted(f)) for f in frees]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class _Cost:
    """One datum's loss, tallied on meta tensors node by node: the bytes alive at once, and its
    forward FLOPs, against budgets that grow with the datum's inputs. A value is alive from its
    node to the last node that reads it, unless autograd keeps it for the backward: the arguments
    of an op whose result requires grad, and that result, are kept to the end (an upper bound on
    what the op saves). The backward then holds what was kept plus gradients about as large as
    the largest kept value, twice. Inputs are the caller's memory, not the loss's."""

    def __init__(self, loss: str, args: list[torch.Tensor]):
        self.loss = loss
        input_bytes = sum(a.numel() * a.element_size() for a in args)
        self.max_elements = GROWTH * max(a.numel() for a in args) + SLACK
        self.max_bytes = min(LIVE_CEILING, max(LIVE_FLOOR, LIVE_GROWTH * input_bytes))
        self.max_flops = FLOPS_PER_ELEMENT * sum(a.numel() for a in args) + FLOP_FLOOR
        self.held: dict[str, int] = {}      # node -> the bytes its value holds
        self.kept: set[str] = set()
        self.live = self.peak = self.kept_bytes = self.largest_kept = self.flops = 0

    def add(self, node, call_args: list, out: Any, reads: set[str], frees: tuple[str, ...]) -> None:
        self.flops += _flops(node, call_args, out)
        if self.flops > self.max_flops:
            self._fail(node, f"its forward pass would take {self.flops:.3g} FLOPs, over the FLOP budget of "
                             f"{self.max_flops:.3g} per datum ({FLOPS_PER_ELEMENT} per input element + {FLOP_FLOOR})",
                       "multiply smaller tensors, or fewer")
        self.held[node.name] = _nbytes(out)
        self.live += self.held[node.name]
        if any(t.requires_grad for t in _tensors(out)):
            for name in (*reads, node.name):
                self._keep(name)
        self.peak = max(self.peak, self.live)
        if self.peak > self.max_bytes:
            self._fail(node, f"it would hold {self.peak} bytes at once, over the memory budget of {self.max_bytes} "
                             f"bytes per datum ({LIVE_GROWTH} times its inputs' bytes, at least {LIVE_FLOOR}, at "
                             f"most {LIVE_CEILING})", "keep fewer or smaller values alive (float32, not float64)")
        for name in frees:
            if name not in self.kept:
                self.live -= self.held.get(name, 0)

    def _keep(self, name: str) -> None:
        if name in self.held and name not in self.kept:
            self.kept.add(name)
            self.kept_bytes += self.held[name]
            self.largest_kept = max(self.largest_kept, self.held[name])

    def finish(self) -> None:
        backward = self.kept_bytes + 2 * self.largest_kept
        if backward > self.max_bytes:
            raise UserError(f"custom loss {self.loss!r}: its backward would hold {backward} bytes (what autograd "
                            f"keeps, {self.kept_bytes}, and its gradients), over the memory budget of "
                            f"{self.max_bytes} bytes per datum ({LIVE_GROWTH} times its inputs' bytes, at least "
                            f"{LIVE_FLOOR}, at most {LIVE_CEILING})")
        self.peak = max(self.peak, backward)

    def _fail(self, node, why: str, fix: str):
        raise UserError(f"custom loss {self.loss!r}: at node {node.name} ({node.target}) {why}; {fix}")


_MATMULS = {"operator.matmul"}


def _flops(node, call_args: list, out: Any) -> int:
    """A node's forward FLOPs: a matmul 2 per multiply-add; any other op one per element it reads or makes."""
    out_elements = sum(t.numel() for t in _tensors(out))
    if node.target in _MATMULS and len(call_args) == 2 and isinstance(call_args[0], torch.Tensor):
        inner = call_args[0].shape[-1] if call_args[0].dim() else 1
        return 2 * max(out_elements, 1) * inner
    return max(out_elements, sum(t.numel() for t in _tensors(call_args)))


_INDEXING = {"operator.getitem", "torch.gather", "gather"}
_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8)      # uint8 and bool index as masks


def _check_indices(loss: str, node, call_args: list) -> None:
    """Integer index tensors in range, checked on their values before they are used (a real run
    only: meta tensors have none)."""
    if node.target == "operator.getitem":
        base, index = call_args
        if isinstance(base, torch.Tensor) and base.device.type != "meta":
            _check_getitem(loss, node, base, index)
        return
    base, dim, index = call_args
    if not (isinstance(base, torch.Tensor) and isinstance(index, torch.Tensor) and isinstance(dim, int)):
        return
    rank = max(base.dim(), 1)
    if base.device.type == "meta" or not -rank <= dim < rank or index.dtype not in _INTEGER:
        return                                  # torch refuses these itself, before any kernel
    _in_range(loss, node, index, 0, base.shape[dim] if base.dim() else 1, dim)


def _check_getitem(loss: str, node, base: torch.Tensor, index: Any) -> None:
    items = [_as_index(i) for i in _index_items(index)]
    used = sum(_dims_used(i) for i in items if i is not Ellipsis)
    dim = 0
    for item in items:
        if item is Ellipsis:
            dim += max(base.dim() - used, 0)
            continue
        if isinstance(item, torch.Tensor) and item.dtype in _INTEGER and dim < base.dim():
            size = base.shape[dim]
            _in_range(loss, node, item, -size, size, dim)
        dim += _dims_used(item)


def _index_items(index: Any) -> tuple:
    """An index as torch reads it: a tuple of per-dim items (a short list holding tensors,
    sequences, slices, None or Ellipsis counts as a tuple, as in torch's indexing)."""
    if isinstance(index, tuple):
        return index
    if isinstance(index, list) and len(index) < 32 and any(
            isinstance(i, (torch.Tensor, list, tuple, slice)) or i is None or i is Ellipsis for i in index):
        return tuple(index)
    return (index,)


def _as_index(item: Any) -> Any:
    """A list of integers as the tensor torch makes of it; anything else as it is."""
    if isinstance(item, (list, tuple)):
        try:
            return torch.as_tensor(item)
        except (TypeError, ValueError, RuntimeError):
            return item
    return item


def _dims_used(item: Any) -> int:
    if item is None or isinstance(item, bool):
        return 0
    if isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8):
        return item.dim()
    return 1


def _in_range(loss: str, node, index: torch.Tensor, low: int, high: int, dim: int) -> None:
    if index.numel() == 0:
        return
    smallest, largest = (int(v) for v in torch.aminmax(index.detach()))
    if smallest < low or largest >= high:
        bad = smallest if smallest < low else largest
        raise UserError(f"custom loss {loss!r}: node {node.name} ({node.target}) indexes dim {dim} of size "
                        f"{high} with {bad}: an index must be in [{low}, {high})")


def _check_size(name: str, node, out: Any, limit: int | None) -> None:
    if isinstance(out, int) and not isinstance(out, bool) and abs(out) > 2**63:
        raise UserError(f"custom loss {name!r}: node {node.name} ({node.target}) makes an integer beyond 64 bits")
    if limit is None:
        return
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor) and t.numel() > limit:
            raise UserError(f"custom loss {name!r}: node {node.name} ({node.target}) makes a tensor of shape "
                            f"{list(t.shape)} ({t.numel()} elements); at most {limit} here ({GROWTH} times the "
                            f"largest input, plus {SLACK}): check the broadcasting of its arguments")


class Losses:
    """Built losses by (model, loss id, spec digest): built once, reused by every forward_backward."""

    def __init__(self, capacity: int = 256):
        self._built: collections.OrderedDict[tuple, CompiledLoss] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.builds = 0

    def get(self, model_id: str, loss_id: str, canonical: str) -> CompiledLoss:
        if not loss_id or not canonical:
            raise UserError("loss_fn 'custom' needs a custom loss: create it with ServiceClient.create_custom_loss "
                            "and pass its LossHandle to forward_backward_custom")
        key = (model_id, loss_id, hashlib.sha256(canonical.encode()).hexdigest())
        with self._lock:
            built = self._built.get(key)
            if built is not None:
                self._built.move_to_end(key)
                return built
        built = CompiledLoss(spec_mod.from_canonical(canonical))
        with self._lock:
            self.builds += 1
            self._built[key] = built
            while len(self._built) > self._capacity:
                self._built.popitem(last=False)
        return built
