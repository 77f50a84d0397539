"""Server-side custom losses: a checked graph (tinkerd/custom_loss.py) built into an interpreter
over a fixed table of torch callables, and run per datum inside forward_backward (training.py).

Nothing of the client's is run as code: each node's name picks an entry of FUNCTIONS or METHODS
below, its arguments are earlier nodes' values or constants. Before a datum runs for real, the
graph runs once on meta tensors of the datum's shapes (no memory, no compute): a shape mismatch
is the caller's error, named with its node, and no intermediate may hold more than
`max_elements` (a broadcast of [T, 1] by [1, T] would ask for T^2). The meta run is cached per
input shapes.

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
            limit = GROWTH * max(a.numel() for a in args) + SLACK
            self._evaluate([torch.empty(s, dtype=d, device="meta") for s, d in shapes], limit)
            if len(self._checked_shapes) > 4096:
                self._checked_shapes.clear()
            self._checked_shapes.add(shapes)
        return self._evaluate(args, None)

    def _evaluate(self, args: list[torch.Tensor], limit: int | None):
        values: dict[str, Any] = {}
        for node in self.spec.nodes:
            if node.op == "placeholder":
                values[node.name] = args[len(values)]
                continue
            if node.op == "output":
                return self._result(self._value(node.args[0], values))
            call_args = [self._value(a, values) for a in node.args]
            call_kwargs = {k: self._value(v, values) for k, v in node.kwargs.items()}
            fn = FUNCTIONS[node.target] if node.op == "call_function" else METHODS[node.target]
            _guard_python_values(node, call_args)
            if node.target == "torch.tensor":      # a constant, made where the inputs are
                call_kwargs["device"] = args[0].device
            try:
                out = fn(*call_args, **call_kwargs)
            except Exception as e:  # noqa: BLE001 - any failure of the user's graph is theirs to fix
                raise UserError(f"custom loss {self.name!r}: node {node.name} ({node.target}) failed: "
                                f"{type(e).__name__}: {str(e)[:300]}") from None
            _check_size(self.name, node, out, limit)
            values[node.name] = out
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
