"""The structure docs/architecture.md describes, checked: layers import only downwards, no
function is longer than a screen, route modules stay small, and no route is a closure."""

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ["tinkerd", "gateway", "trainer_service", "sampler_service", "launcher", "harness", "bench"]
# What each layer may import of this project (everything else is third-party or the stdlib).
MAY_IMPORT = {
    "tinkerd": {"tinkerd"},
    "gateway": {"tinkerd", "gateway"},
    "trainer_service": {"tinkerd", "trainer_service"},
    "sampler_service": {"tinkerd", "sampler_service"},
    "harness": {"tinkerd", "harness"},
    "launcher": {"tinkerd", "gateway", "trainer_service", "sampler_service", "launcher", "harness"},
}
MAX_FUNCTION_LINES = 60
MAX_ROUTE_MODULE_LINES = 250
_ROUTE_DECORATORS = {"get", "post", "put", "delete", "patch", "api_route", "route"}


def _modules(packages=PACKAGES):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path, ast.parse(path.read_text())


def _imported(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_layers_import_only_downwards():
    ours = set(MAY_IMPORT)
    wrong = [f"{path.relative_to(ROOT)} imports {sorted((_imported(tree) & ours) - MAY_IMPORT[package])}"
             for package in MAY_IMPORT for path, tree in _modules([package])
             if (_imported(tree) & ours) - MAY_IMPORT[package]]
    assert not wrong, wrong


def test_no_function_is_longer_than_a_screen():
    """(Schema migrations are DDL listings, not logic: exempt.)"""
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules() if "migrations" not in path.parts for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


@pytest.mark.parametrize("path", sorted((ROOT / "gateway" / "routes").glob("*.py")), ids=lambda p: p.name)
def test_route_modules_are_small(path):
    assert len(path.read_text().splitlines()) < MAX_ROUTE_MODULE_LINES


@pytest.mark.parametrize("path", sorted((ROOT / "gateway").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_route_is_defined_inside_a_function(path):
    """Anywhere in the gateway (a route made inside install() or create_app is hidden from a reader
    of the routers)."""
    tree = ast.parse(path.read_text())
    for outer in ast.walk(tree):
        if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(outer):
            if inner is not outer and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = {d.func.attr for d in inner.decorator_list
                              if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)}
                assert not decorators & _ROUTE_DECORATORS, f"route {inner.name} is defined inside {outer.name}"


def test_every_route_is_mounted():
    from gateway.app import create_app  # noqa: F401 - imports every route module
    from gateway.routes import ROUTERS

    modules = {p.stem for p in (ROOT / "gateway" / "routes").glob("*.py")} - {"__init__"}
    mounted = {r.routes[0].endpoint.__module__.rsplit(".", 1)[1] for r in ROUTERS}
    assert mounted == modules


def _gateway_modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports_of(name: str, path: pathlib.Path, known: dict, tree: ast.AST | None = None) -> set[str]:
    """The project modules `name` imports, at the top or inside functions."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree or ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base] * bool(base))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_import_cycles_between_gateway_modules():
    """Imports inside functions count too: they hid the db <-> schema circle."""
    known = _gateway_modules()
    graph = {name: _imports_of(name, path, known) for name, path in known.items()}
    cycles = []

    def walk(name: str, trail: list[str]) -> None:
        for target in graph[name]:
            if target in trail:
                cycles.append(trail[trail.index(target):] + [target])
            elif target not in seen:
                seen.add(target)
                walk(target, trail + [target])
    for start in graph:
        seen = {start}
        walk(start, [start])
    assert not cycles, cycles[:5]


def _runtime_graph() -> dict[str, set[str]]:
    """The gateway's imports as they run: those under `if TYPE_CHECKING:` name a type only."""
    known = _gateway_modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "attr", getattr(node.test, "id", "")) == "TYPE_CHECKING":
                node.body = []
        graph[name] = _imports_of(name, path, known, tree)
    return graph


def test_the_gateways_import_graph_is_at_most_ten_deep():
    """The longest chain of imports, from the server down to the storage, stays short: each layer
    (routes -> the container -> identity -> storage) adds one floor, not several."""
    graph = _runtime_graph()

    @functools.cache
    def deepest(name: str) -> tuple[str, ...]:
        chains = [deepest(target) for target in graph[name]]
        return (name, *max(chains, key=len, default=()))
    longest = max((deepest(name) for name in graph), key=len)
    assert len(longest) - 1 <= 10, " -> ".join(longest)


def test_jobs_import_neither_housekeeping_nor_the_container():
    """A job runs with what it is handed; the container (gateway/state.py) and the background tasks
    (gateway/housekeeping.py) sit above the jobs."""
    graph = _runtime_graph()
    for name, targets in graph.items():
        if name.startswith("gateway.jobs"):
            assert not targets & {"gateway.housekeeping", "gateway.state"}, (name, targets)


@pytest.mark.parametrize("path", sorted((ROOT / "gateway" / "routes").glob("*.py")), ids=lambda p: p.name)
def test_routes_start_work_only_through_the_job_engine(path):
    """A route hands its job to gateway/jobs/engine.py Jobs.submit, never to the futures directly."""
    source = path.read_text()
    for other in ("futures.submit(", "submit_training(", "Refused("):
        assert other not in source, f"{path.name} calls {other}: use gw.jobs.submit"
