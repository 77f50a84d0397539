"""Server-side custom losses (SDK >= 0.36 `ServiceClient.create_custom_loss`): the traced graph
the client uploads, checked as plain data. Torch-free: the gateway checks a graph here when it is
created, the trainer checks it again here before building it from its own op table
(trainer_service/custom_loss.py).

The client sends torch.fx's nodes in execution order (tinker.types.CustomLossGraph): placeholders
(logprobs, then the loss_fn_inputs keys the loss reads), calls of functions and tensor methods by
name, one output `(loss, {metric: value})`. Nothing in it is ever run as code: every call names an
entry of FUNCTIONS or METHODS below (anything else is refused, naming it), every argument is a
reference to an earlier node or a plain constant, and the trainer maps each name to a torch
callable of its fixed table. References only go backwards, so a graph cannot have a cycle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from typing import Any

from tinkerd import custom_loss_shapes
from tinkerd.errors import UserError

MAX_NODES = 512                 # torch.fx nodes of one loss (a PPO or DPO loss takes 10 to 30)
MAX_INPUTS = 16                 # the SDK's own limit, logprobs included
MAX_GRAPH_BYTES = 256 << 10     # the graph as canonical JSON
MAX_REQUEST_BYTES = 512 << 10   # a create_custom_loss body, inflated (gateway/body_limit.py)
MAX_ARG_DEPTH = 8               # nesting of tuples, lists, dicts and slices in one argument
MAX_CONSTANT_ITEMS = 1024       # items of one list or tuple constant
MAX_NAME = 128                  # a node's or the loss's name
MAX_LOSSES_PER_SESSION = 256    # stored losses one session may create

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_LOSS_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,128}")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "bool")


@dataclasses.dataclass(frozen=True)
class Arity:
    """How a call may be made: `lo`..`hi` positional arguments and these keywords."""
    lo: int
    hi: int
    kwargs: tuple[str, ...] = ()


_UNARY, _BINARY = Arity(1, 1), Arity(2, 2)
_REDUCE = Arity(1, 3, ("dim", "keepdim", "dtype"))
_SOFTMAX = Arity(1, 3, ("dim", "dtype"))
_CLAMP = Arity(1, 3, ("min", "max"))
_MINMAX = Arity(1, 3, ("dim", "keepdim"))

# call_function targets, as the SDK names them (its encode_graph: fx's qualified name, with
# `_operator.` written `operator.`). No op here makes a tensor of a size given as a number
# (torch.ones, arange, expand, repeat...): every tensor's size follows from the inputs', which
# the trainer bounds (trainer_service/custom_loss.py). No randomness, no in-place ops.
FUNCTIONS: dict[str, Arity] = {
    **{f"operator.{op}": _BINARY for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                            "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor",
                                            "getitem")},
    **{f"operator.{op}": _UNARY for op in ("neg", "pos", "abs", "invert")},
    "getattr": _BINARY,                 # only the attributes in ATTRIBUTES
    **{f"torch.{op}": _UNARY for op in ("exp", "log", "log1p", "expm1", "sigmoid", "tanh", "sqrt", "rsqrt", "abs",
                                        "neg", "sign", "square", "reciprocal", "relu", "isfinite", "logical_not")},
    **{f"torch.{op}": _BINARY for op in ("minimum", "maximum", "logical_and", "logical_or", "clamp_min",
                                         "clamp_max", "unsqueeze", "logaddexp")},
    "torch.pow": _BINARY,
    "torch.clamp": _CLAMP, "torch.clip": _CLAMP,
    "torch.where": Arity(3, 3),
    "torch.sum": _REDUCE, "torch.mean": _REDUCE,
    "torch.amax": Arity(1, 3, ("dim", "keepdim")), "torch.amin": Arity(1, 3, ("dim", "keepdim")),
    "torch.max": _MINMAX, "torch.min": _MINMAX,
    "torch.logsumexp": Arity(2, 3, ("dim", "keepdim")),
    "torch.softmax": _SOFTMAX, "torch.log_softmax": _SOFTMAX,
    "torch.nn.functional.softmax": _SOFTMAX, "torch.nn.functional.log_softmax": _SOFTMAX,
    "torch._C._nn.log_sigmoid": _UNARY,                 # torch.nn.functional.logsigmoid
    "torch._C._nn.softplus": Arity(1, 3, ("beta", "threshold")),
    "torch.squeeze": Arity(1, 2, ("dim",)),
    "torch.cumsum": Arity(2, 2, ("dim", "dtype")),
    "torch.gather": Arity(3, 3),
    "torch.stack": Arity(1, 2, ("dim",)), "torch.cat": Arity(1, 2, ("dim",)),
    "torch.ones_like": Arity(1, 1, ("dtype",)), "torch.zeros_like": Arity(1, 1, ("dtype",)),
    "torch.full_like": Arity(2, 2, ("dtype",)),
    "torch.tensor": Arity(1, 1, ("dtype",)),            # of a constant: bounded by MAX_CONSTANT_ITEMS
}

# call_method targets: torch.Tensor methods; the receiver is the first argument.
METHODS: dict[str, Arity] = {
    **{op: _UNARY for op in ("exp", "log", "log1p", "expm1", "sigmoid", "tanh", "sqrt", "rsqrt", "abs", "neg",
                             "sign", "square", "reciprocal", "relu", "detach", "float", "double", "long", "int",
                             "bool", "t", "contiguous", "isfinite", "logical_not", "numel", "dim")},
    **{op: _BINARY for op in ("mul", "add", "sub", "div", "pow", "minimum", "maximum", "eq", "ne", "gt", "lt",
                              "ge", "le", "clamp_min", "clamp_max", "expand_as", "type_as", "unsqueeze",
                              "logical_and", "logical_or", "logaddexp")},
    "sum": _REDUCE, "mean": _REDUCE,
    "amax": Arity(1, 3, ("dim", "keepdim")), "amin": Arity(1, 3, ("dim", "keepdim")),
    "max": _MINMAX, "min": _MINMAX,
    "logsumexp": Arity(2, 3, ("dim", "keepdim")),
    "softmax": _SOFTMAX, "log_softmax": _SOFTMAX,
    "clamp": _CLAMP, "clip": _CLAMP,
    "size": Arity(1, 2, ("dim",)),
    "squeeze": Arity(1, 2, ("dim",)),
    "view": Arity(2, 9), "reshape": Arity(2, 9), "flatten": Arity(1, 3, ("start_dim", "end_dim")),
    "transpose": Arity(3, 3),
    "cumsum": Arity(2, 2, ("dim", "dtype")),
    "gather": Arity(3, 3),
    "masked_fill": Arity(3, 3),
    "where": Arity(3, 3),
    "to": Arity(2, 2),                 # to(dtype) only
    "any": Arity(1, 3, ("dim", "keepdim")), "all": Arity(1, 3, ("dim", "keepdim")),
}

ATTRIBUTES = ("shape", "ndim", "dtype")    # getattr(tensor, name)


@dataclasses.dataclass(frozen=True)
class Node:
    op: str             # placeholder | call_function | call_method | output
    name: str
    target: str
    args: tuple
    kwargs: dict


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A checked custom loss: what the gateway stores and the trainer builds."""
    name: str
    inputs: tuple[tuple[str, int], ...]     # (name, rank), logprobs first
    nodes: tuple[Node, ...]
    metric_keys: tuple[str, ...]
    canonical: str                          # the spec as JSON: stored, sent to the trainer
    digest: str                             # its SHA-256

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs keys the loss reads, in its order (logprobs is not one)."""
        return tuple(name for name, _ in self.inputs[1:])


def _fail(message: str):
    raise UserError(f"create_custom_loss: {message}")


class _Budget:
    """What the walk has read so far, as a lower bound of its canonical JSON's bytes: each item is
    at least one character and a separator, a string its length. The walk stops once that passes
    MAX_GRAPH_BYTES, so parsing costs at most a graph's worth however large the upload is."""

    def __init__(self):
        self.left = MAX_GRAPH_BYTES

    def spend(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            _fail(f"the graph is over {MAX_GRAPH_BYTES} bytes as JSON (the most a graph may be)")


def parse(name: Any, inputs: Any, graph: Any) -> LossSpec:
    """The SDK's create_custom_loss fields, checked; any problem is a UserError naming it."""
    if not isinstance(name, str) or not _LOSS_NAME.fullmatch(name):
        _fail(f"name must be 1 to {MAX_NAME} printable characters")
    parsed_inputs = _inputs(inputs)
    if not isinstance(graph, dict):
        _fail("graph must be an object {format, nodes}")
    if graph.get("format", 1) != 1:
        _fail(f"graph format {graph.get('format')!r} is not supported; this server reads format 1")
    raw_nodes = graph.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        _fail("graph.nodes must be a non-empty list")
    if len(raw_nodes) > MAX_NODES:
        _fail(f"the graph has {len(raw_nodes)} nodes; at most {MAX_NODES}")
    nodes: list[Node] = []
    seen: set[str] = set()
    budget = _Budget()
    for i, raw in enumerate(raw_nodes):
        node = _node(i, raw, seen, parsed_inputs, len(raw_nodes), budget)
        seen.add(node.name)
        nodes.append(node)
    metric_keys = _output(nodes[-1])
    body = {"name": name, "inputs": [{"name": n, "rank": r} for n, r in parsed_inputs],
            "graph": {"format": 1, "nodes": [{"op": n.op, "name": n.name, "target": n.target, "args": list(n.args),
                                              "kwargs": n.kwargs} for n in nodes]}}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    if len(canonical) > MAX_GRAPH_BYTES:
        _fail(f"the graph is {len(canonical)} bytes as JSON; at most {MAX_GRAPH_BYTES}")
    spec = LossSpec(name, parsed_inputs, tuple(nodes), metric_keys, canonical,
                    hashlib.sha256(canonical.encode()).hexdigest())
    custom_loss_shapes.infer(spec)
    return spec


def from_canonical(canonical: str) -> LossSpec:
    """A spec the gateway stored (or sent the trainer), checked again: the reader trusts no row."""
    try:
        body = json.loads(canonical)
    except ValueError as e:
        raise UserError(f"custom loss spec is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise UserError("custom loss spec must be an object")
    return parse(body.get("name"), body.get("inputs"), body.get("graph"))


def _inputs(inputs: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, list) or not inputs:
        _fail("inputs must list the loss's parameters, logprobs first")
    if len(inputs) > MAX_INPUTS:
        _fail(f"the loss takes {len(inputs)} inputs; at most {MAX_INPUTS}, logprobs included")
    out = []
    for i, item in enumerate(inputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            _fail(f"inputs[{i}] must be {{name, rank}}")
        name, rank = item["name"], item.get("rank")
        if not _INPUT_NAME.fullmatch(name):
            _fail(f"input {name[:64]!r} must be a lowercase name of letters, digits and underscores")
        if type(rank) is not int or rank not in (0, 1, 2):
            _fail(f"input {name!r} has rank {rank!r}; a rank is 0 (scalar), 1 ([T]) or 2 ([T, K])")
        out.append((name, rank))
    if out[0][0] != "logprobs":
        _fail(f"the first input must be logprobs, got {out[0][0]!r}")
    if out[0][1] != 1:
        _fail(f"logprobs must have rank 1 ([T]), got {out[0][1]}: tinkerd computes one logprob per target token "
              f"(target_tokens of shape [T])")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        _fail(f"inputs name a parameter twice: {names}")
    if "target_tokens" in names[1:]:
        _fail("target_tokens is not an input a loss may read; logprobs are the target tokens' logprobs")
    return tuple(out)


def _node(i: int, raw: Any, seen: set[str], inputs, count: int, budget: _Budget) -> Node:
    if not isinstance(raw, dict):
        _fail(f"node {i} must be an object")
    op, name, target = raw.get("op"), raw.get("name"), raw.get("target")
    args, kwargs = raw.get("args", []), raw.get("kwargs", {})
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        _fail(f"node {i}: name {str(name)[:64]!r} must be an identifier of at most {MAX_NAME} characters")
    where = f"node {i} ({name})"
    if name in seen:
        _fail(f"{where}: the name is used by an earlier node; node names are unique")
    if not isinstance(target, str) or len(target) > 256:
        _fail(f"{where}: target must be a string")
    budget.spend(len(name) + len(target) + 40)      # the node's keys and its op
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        _fail(f"{where}: args must be a list and kwargs an object")
    if op == "placeholder":
        if i >= len(inputs) or target != inputs[i][0] or args or kwargs:
            _fail(f"{where}: placeholder {target!r} is not input {i}; the graph's first nodes are its "
                  f"inputs in order ({', '.join(n for n, _ in inputs)})")
        return Node(op, name, target, (), {})
    if i < len(inputs):
        _fail(f"{where}: the graph has fewer placeholders than inputs ({len(inputs)})")
    if op == "output":
        if i != count - 1:
            _fail(f"{where}: the output node must be the last node")
        if len(args) != 1 or kwargs:
            _fail(f"{where}: the output node takes one argument, (loss, metrics)")
        return Node(op, name, target, (_arg(args[0], seen, where, 0, budget),), {})
    if i == count - 1:
        _fail("the graph's last node must be its output")
    if op == "call_function":
        arity = FUNCTIONS.get(target)
        if arity is None:
            _fail(f"{where}: function {target!r} is not allowed in a server-side custom loss; see the "
                  f"allowed operations in docs/compatibility.md")
    elif op == "call_method":
        arity = METHODS.get(target)
        if arity is None:
            _fail(f"{where}: tensor method {target!r} is not allowed in a server-side custom loss; see the "
                  f"allowed operations in docs/compatibility.md")
    elif op in ("get_attr", "call_module"):
        _fail(f"{where}: {op} nodes are not allowed: a custom loss may only read its inputs and call torch "
              f"functions")
    else:
        _fail(f"{where}: unknown node op {str(op)[:32]!r}")
    if not arity.lo <= len(args) <= arity.hi:
        count_text = str(arity.lo) if arity.lo == arity.hi else f"{arity.lo} to {arity.hi}"
        _fail(f"{where}: {target} takes {count_text} positional arguments, got {len(args)}")
    bad = sorted(set(kwargs) - set(arity.kwargs))
    if bad:
        _fail(f"{where}: {target} takes no keyword argument {bad[0]!r}"
              + (f" (allowed: {', '.join(arity.kwargs)})" if arity.kwargs else ""))
    if target == "getattr" and args[1] not in ATTRIBUTES:
        _fail(f"{where}: getattr of {str(args[1])[:64]!r} is not allowed; only {', '.join(ATTRIBUTES)}")
    parsed_args = tuple(_arg(a, seen, where, 0, budget) for a in args)
    parsed_kwargs = {k: _arg(v, seen, where, 0, budget) for k, v in kwargs.items()}
    if target == "to" and not (isinstance(parsed_args[1], dict) and "dtype" in parsed_args[1]):
        _fail(f"{where}: Tensor.to takes a dtype only (the trainer decides where tensors live)")
    return Node(op, name, target, parsed_args, parsed_kwargs)


def _arg(value: Any, seen: set[str], where: str, depth: int, budget: _Budget) -> Any:
    """An encoded argument, checked (the SDK's encoding: tinker.types.CustomLossNode.args)."""
    if depth > MAX_ARG_DEPTH:
        _fail(f"{where}: an argument nests deeper than {MAX_ARG_DEPTH}")
    budget.spend(2)
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
            _fail(f"{where}: integer constant {value} is out of the 64-bit range")
        if isinstance(value, str):
            if len(value) > 256:
                _fail(f"{where}: a string constant is over 256 characters")
            budget.spend(len(value))
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            _fail(f"{where}: a non-finite float must be sent as {{\"float\": ...}}")
        return value
    if isinstance(value, list):
        if len(value) > MAX_CONSTANT_ITEMS:
            _fail(f"{where}: a list constant has {len(value)} items; at most {MAX_CONSTANT_ITEMS}")
        numbers = _numbers(value, where, budget)
        return numbers if numbers is not None else [_arg(v, seen, where, depth + 1, budget) for v in value]
    if not isinstance(value, dict) or len(value) != 1:
        _fail(f"{where}: an argument must be a JSON scalar, a list or a one-key object")
    (kind, inner), = value.items()
    budget.spend(len(str(kind)) + 6)       # {"kind":...}
    if kind == "ref":
        if inner not in seen:
            _fail(f"{where}: refers to {str(inner)[:64]!r}, which is no earlier node (unknown input, "
                  f"or a cycle)")
        budget.spend(len(inner))
        return {"ref": inner}
    if kind in ("tuple", "slice"):
        if not isinstance(inner, list) or len(inner) > MAX_CONSTANT_ITEMS or (kind == "slice" and len(inner) != 3):
            _fail(f"{where}: a {kind} must be a list" + (" of [start, stop, step]" if kind == "slice" else ""))
        return {kind: [_arg(v, seen, where, depth + 1, budget) for v in inner]}
    if kind == "dict":
        if not isinstance(inner, dict) or len(inner) > MAX_CONSTANT_ITEMS:
            _fail(f"{where}: a dict must be an object")
        out = {}
        for k, v in inner.items():
            key = str(k)[:256]
            budget.spend(len(key))
            out[key] = _arg(v, seen, where, depth + 1, budget)
        return {"dict": out}
    if kind == "ellipsis" and inner is True:
        return {"ellipsis": True}
    if kind == "float" and inner in ("inf", "-inf", "nan"):
        return {"float": inner}
    if kind == "dtype":
        if inner not in DTYPES:
            _fail(f"{where}: dtype {str(inner)[:32]!r} is not allowed; one of {', '.join(DTYPES)}")
        return {"dtype": inner}
    if kind in ("device", "layout", "memory_format"):
        _fail(f"{where}: a {kind} argument is not allowed: the trainer decides where and how tensors live")
    _fail(f"{where}: unknown argument kind {str(kind)[:32]!r}")


def _numbers(value: list, where: str, budget: _Budget) -> list | None:
    """A list of plain numbers, checked as `_arg` checks each (in one pass: a constant of a
    thousand numbers is common); None if it holds anything else."""
    kinds = set(map(type, value))
    if not kinds <= {int, float, bool}:
        return None
    budget.spend(2 * len(value))
    if float in kinds and not all(math.isfinite(v) for v in value if type(v) is float):
        _fail(f"{where}: a non-finite float must be sent as {{\"float\": ...}}")
    if int in kinds and any(abs(v) > 2**63 for v in value if type(v) is int):
        _fail(f"{where}: an integer constant is out of the 64-bit range")
    return list(value)


def _output(node: Node) -> tuple[str, ...]:
    """The metric keys of a well-formed output `(loss, {key: tensor})`."""
    if node.op != "output":
        _fail("the graph's last node must be its output")
    out = node.args[0]
    items = out.get("tuple") if isinstance(out, dict) else out
    if not isinstance(items, list) or len(items) != 2:
        _fail("the loss must return (loss, metrics)")
    loss, metrics = items
    if not (isinstance(loss, dict) and "ref" in loss):
        _fail("the loss must return its loss as a tensor computed from its inputs")
    if not (isinstance(metrics, dict) and "dict" in metrics):
        _fail("the loss must return its metrics as a dict")
    for key, value in metrics["dict"].items():
        if not _METRIC_KEY.fullmatch(key):
            _fail(f"metric {key[:80]!r} must be named custom/<name>:sum or custom/<name>:mean in lowercase")
        if not (isinstance(value, dict) and "ref" in value):
            _fail(f"metric {key!r} must be a tensor computed by the loss")
    return tuple(metrics["dict"])
