"""Shapes of a custom loss's graph, inferred without torch when it is created (the gateway has no
torch): inputs are [T] (rank 1), [T, K] (rank 2) or [] (rank 0), with T and K unknown sizes, and
each op's result shape follows from its arguments'. A mismatch every datum would hit -- [T] * [T, K]
broadcasts T against K -- or a loss that is not a scalar is refused at create_custom_loss, naming
the node. Ops whose shape rule is not modelled here give an unknown shape and are not checked
here: the trainer checks every datum's shapes on meta tensors before it runs
(trainer_service/custom_loss.py).

A dim is an int, a symbol ("T", "K") or None (unknown); a shape is a tuple of dims, or None.
"""

from __future__ import annotations

from typing import Any

from tinkerd.errors import UserError

_SAME = {"exp", "log", "log1p", "expm1", "sigmoid", "tanh", "sqrt", "rsqrt", "abs", "neg", "sign", "square",
         "reciprocal", "relu", "isfinite", "logical_not", "detach", "float", "double", "long", "int", "bool",
         "contiguous", "softmax", "log_softmax", "cumsum", "log_sigmoid", "softplus", "clamp", "clip", "clamp_min",
         "clamp_max", "ones_like", "zeros_like", "full_like", "to", "type_as", "pos", "invert", "masked_fill"}
_BROADCAST = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "lt", "le", "gt", "ge", "eq", "ne", "and_",
              "or_", "xor", "minimum", "maximum", "logical_and", "logical_or", "logaddexp", "div", "where"}
_REDUCE = {"sum", "mean", "amax", "amin", "logsumexp", "any", "all"}


PY = "python"      # a Python value (a number, a dim of a shape): broadcasts as a scalar


def infer(spec) -> None:
    """Raises a UserError for a shape mismatch or a loss / metric that is not a scalar."""
    shapes: dict[str, Any] = {}
    for (name, rank), node in zip(spec.inputs, spec.nodes):
        shapes[node.name] = (("T", "K")[:rank] if rank else ())
    for node in spec.nodes[len(spec.inputs):]:
        if node.op == "output":
            _check_output(spec.name, node, shapes)
            return
        try:
            shapes[node.name] = _shape_of(node, shapes)
        except _Mismatch as e:
            raise UserError(f"create_custom_loss: node {node.name} ({node.target}): {e} (T is a datum's number "
                            f"of tokens, K the second dim of its rank-2 inputs)") from None


class _Mismatch(Exception):
    pass


def _arg_shape(arg: Any, shapes: dict) -> Any:
    if isinstance(arg, dict) and "ref" in arg:
        return shapes.get(arg["ref"])
    if isinstance(arg, (int, float, bool)) or (isinstance(arg, dict) and "float" in arg):
        return PY
    return None


def _refs(node, shapes: dict) -> list:
    values = [*node.args, *node.kwargs.values()]
    return [shapes.get(a["ref"]) for a in values if isinstance(a, dict) and "ref" in a]


def _shape_of(node, shapes: dict) -> Any:
    op = node.target.rsplit(".", 1)[-1]
    if node.target == "getattr" or op in ("size", "dim", "numel"):
        return PY
    args = [_arg_shape(a, shapes) for a in node.args]
    if node.target.startswith("operator.") and args and all(a == PY for a in args):
        return PY                       # arithmetic on shapes and numbers
    if not args or args[0] is None or args[0] == PY:
        return None
    if op in _SAME:
        refs = _refs(node, shapes)
        return refs[0] if len(refs) == 1 else _broadcast(refs)
    if op in _BROADCAST:
        return _broadcast(args)
    if op in _REDUCE or (op in ("max", "min") and len(node.args) + len(node.kwargs) == 1):
        return _reduce(args[0], node)
    if op == "unsqueeze" and len(node.args) == 2 and isinstance(node.args[1], int):
        dims = list(args[0])
        at = node.args[1] if node.args[1] >= 0 else len(dims) + 1 + node.args[1]
        return tuple(dims[:at] + [1] + dims[at:]) if 0 <= at <= len(dims) else None
    if op == "expand_as" and len(args) == 2:
        return args[1]
    return None


def _broadcast(shapes: list) -> Any:
    shapes = [() if s == PY else s for s in shapes]
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if None in dims:
            out.append(None)
        elif len(dims) > 1:
            raise _Mismatch(f"shapes {' and '.join(_show(s) for s in shapes)} do not broadcast")
        else:
            out.append(dims.pop() if dims else 1)
    return tuple(out)


def _reduce(shape: tuple, node) -> Any:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    if dim is None or shape == ():
        return ()
    dims = dim.get("tuple") if isinstance(dim, dict) else ([dim] if isinstance(dim, int) else dim)
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    axes = {d % len(shape) for d in dims if -len(shape) <= d < len(shape)} if shape else set()
    if len(axes) != len(dims):
        raise _Mismatch(f"dim {dim} is out of range for shape {_show(shape)}")
    if keepdim is True:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _check_output(name: str, node, shapes: dict) -> None:
    loss, metrics = node.args[0].get("tuple", node.args[0]) if isinstance(node.args[0], dict) else node.args[0]
    shape = shapes.get(loss["ref"])
    if isinstance(shape, tuple) and shape != ():
        raise UserError(f"create_custom_loss: {name} returns a loss of shape {_show(shape)}; it must be a scalar "
                        f"(reduce it, e.g. .sum())")
    for key, value in metrics["dict"].items():
        shape = shapes.get(value["ref"])
        if isinstance(shape, tuple) and any(d != 1 for d in shape):
            raise UserError(f"create_custom_loss: {name} metric {key!r} has shape {_show(shape)}; it must be a "
                            f"scalar")


def _show(shape: tuple) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
