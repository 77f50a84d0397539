"""The hops of one forward_backward, measured, against docs/architecture.md ("The path of a
request"): the page's count and its numbered `file:function` lines must be what a traced request
goes through, so the page cannot drift from the code.

A real `tinkerd trainer` and `tinkerd gateway`, started as an operator starts them, each carry a
tracer (hop_trace/hop_tracer.py, loaded by hop_trace/sitecustomize.py); the unmodified SDK sends
one forward_backward. The chain of callers at the computation is stitched across tasks, threads,
work handed to a running worker, and the gRPC call; nothing here names a function of ours except
the computation itself.

The rule (the page's own): a hop is a call from one of our modules into another of ours on that
chain, plus the entry from the server framework into our first frame (hop 1), plus each network
crossing (one hop even between frames of one module). A call that checks or converts and returns
before the request moves on is not on the chain; third-party frames between two of ours are
transparent."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from harness.services import Service
from launcher.up import free_port, service_token_file

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACER = pathlib.Path(__file__).resolve().parent / "hop_trace"
PAGE = ROOT / "docs" / "architecture.md"
OURS = ["gateway", "trainer_service", "sampler_service", "tinkerd", "launcher"]
COMPUTATION = ("trainer_service/training.py", "forward_backward")
GOAL = 12
WAIT_S = 60


@dataclasses.dataclass
class Hop:
    module: str
    functions: list[str]        # the chain's frames in this module, outermost first
    crossing: str = ""          # the RPC this hop arrives by, if it crosses the network

    def line(self, n: int) -> str:
        inner = f" (then {', '.join(self.functions[1:])})" if len(self.functions) > 1 else ""
        how = f", over gRPC {self.crossing}" if self.crossing else ""
        return f"{n}. `{self.module}:{self.functions[0]}`{inner}{how}"


def _env(trace: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    path = [str(TRACER), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0", TINKERD_HOP_TRACE=str(trace),
               PYTHONPATH=os.pathsep.join(path))
    return env


def _wait_for(paths: list[pathlib.Path], services: list[Service]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"no {[p.name for p in paths if not p.exists()]}:\n" + \
            "\n".join(s.text()[-3000:] for s in services)
        time.sleep(0.02)


def _traced_forward_backward(model_dir: str, root: pathlib.Path) -> tuple[list, list]:
    """Trainer and gateway under the tracer; a model made and one forward_backward run through the
    SDK, then the window opened and the measured one sent. Returns the trainer's chain at the
    computation and every gRPC client call recorded."""
    import tinker
    from tinker import types

    from launcher import keys

    trace, state, logs = root / "trace", root / "state", root / "logs"
    for d in (trace, logs):
        d.mkdir()
    os.makedirs(state, mode=0o700)
    (trace / "config.json").write_text(json.dumps({"ours": OURS, "target": COMPUTATION}))
    common = ["--base-model", model_dir, "--state-dir", str(state), "--service-token-file",
              service_token_file(str(state))]
    tinkerd, env, trainer_port = [sys.executable, "-m", "launcher.cli"], _env(trace), free_port()
    services: list[Service] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [s.kill() for s in services])
        services.append(Service("trainer", [*tinkerd, "trainer", *common, "--dtype", "float32",
                                            "--listen", f"127.0.0.1:{trainer_port}"], logs, env))
        # asyncio's loop: the tracer follows a task's hand-offs through that loop's Python frames
        # (uvloop's are C); the hops are our modules' calls, the same on either loop.
        services.append(Service("gateway", [*tinkerd, "gateway", *common, "--trainer", f"127.0.0.1:{trainer_port}",
                                            "--port", "0", "--internal-port", "0", "--event-loop", "asyncio"],
                                logs, env))
        port = services[1].ready()
        services[0].ready()
        api_key = keys.new_key(keys.open_database(str(state), None), "hops", admin=True)
        client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=api_key)
        tc = client.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
        tokens = [5, 9, 17, 33, 2, 71]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        tc.forward_backward([datum], "cross_entropy").result(timeout=WAIT_S)     # the path's first use: not measured
        (trace / "go").touch()
        _wait_for([trace / f"armed-{s.proc.pid}" for s in services], services)
        tc.forward_backward([datum], "cross_entropy").result(timeout=WAIT_S)
        targets = sorted(trace.glob("target-*.json"))
        errors = "".join(p.read_text() for p in trace.glob("errors-*.txt"))
        assert len(targets) == 1 and not errors, (targets, errors)
        found = json.loads(targets[0].read_text())
        assert "chain" in found, found["error"]
        calls = [json.loads(line) for p in trace.glob("calls-*.jsonl") for line in p.read_text().splitlines()]
        return found["chain"], calls


def _joined(chain: list, calls: list) -> list:
    """The chain with each crossing preceded by the chain of the client call it answers: the
    latest call of that method made before the server's side of it."""
    while chain and chain[0][0] == "crossing":
        _, method, at = chain[0]
        before = [c for c in calls if c["method"] == method and c["time"] < at]
        assert before, f"no client call of {method} recorded before the server's ({calls})"
        client = max(before, key=lambda c: c["time"])["chain"]
        assert client, f"the client call of {method} has no frame of ours on its chain"
        chain = client + chain
    return chain


def _hops(chain: list) -> list[Hop]:
    hops: list[Hop] = []
    crossing = ""
    for item in chain:
        if item[0] == "crossing":
            crossing = item[1]
            continue
        _, module, qualname = item
        function = qualname.replace(".<locals>", "")
        if hops and hops[-1].module == module and not crossing:
            if hops[-1].functions[-1] != function:
                hops[-1].functions.append(function)
        else:
            hops.append(Hop(module, [function], crossing))
        crossing = ""
    return hops


# A made-up service for the tracer's own test: the event loop calls a protocol (the entry); it
# hands the request to a task, which puts it into the queue of a task that ran before the request;
# that one submits it to an executor, whose work starts a thread, which queues it for a thread
# that ran before the request too, and that thread computes.
TOY = {
    "ours_a/__init__.py": "",
    "ours_b/__init__.py": "",
    "ours_a/front.py": """
import asyncio
from ours_a import pool

class Protocol(asyncio.Protocol):
    def data_received(self, data):
        asyncio.get_running_loop().create_task(handle({"body": data}))

async def handle(data):
    pool.RUNNER.put(data)
""",
    "ours_a/pool.py": """
import asyncio
import concurrent.futures
from ours_b import work

EXECUTOR = concurrent.futures.ThreadPoolExecutor(1)
RUNNER = None

class Runner:
    def __init__(self):
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._loop())

    def put(self, data):
        self.queue.put_nowait(data)

    async def _loop(self):
        while True:
            data = await self.queue.get()
            await asyncio.get_running_loop().run_in_executor(EXECUTOR, work.start, data)
""",
    "ours_b/work.py": """
import queue
import threading

JOBS = queue.Queue()

def start(data):
    thread = threading.Thread(target=relay, args=(data,))
    thread.start()
    thread.join()

def relay(data):
    done = threading.Event()
    JOBS.put((data, done))
    done.wait()

def worker():
    while True:
        data, done = JOBS.get()
        compute(data)
        done.set()

def compute(data):
    return len(data)
""",
    "drive.py": """
import asyncio, os, sys, threading, time
from ours_a import front, pool
from ours_b import work

async def main(trace):
    threading.Thread(target=work.worker, daemon=True).start()
    pool.RUNNER = pool.Runner()
    server = await asyncio.get_running_loop().create_server(front.Protocol, "127.0.0.1", 0)
    open(os.path.join(trace, "go"), "w").close()
    while not os.path.exists(os.path.join(trace, f"armed-{os.getpid()}")):
        await asyncio.sleep(0.01)
    _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    writer.write(b"a request")
    await writer.drain()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(trace, f"target-{os.getpid()}.json")) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)

asyncio.run(main(sys.argv[1]))
""",
}


def test_the_tracer_follows_a_request_across_tasks_threads_and_running_workers(tmp_path):
    """The tracer's own test, on TOY: every hand-off stitched, no function of it named to the tracer."""
    root, trace = tmp_path / "toy", tmp_path / "trace"
    for name, text in TOY.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    trace.mkdir()
    (trace / "config.json").write_text(json.dumps({"ours": ["ours_a", "ours_b"], "root": str(root),
                                                   "target": ["ours_b/work.py", "compute"]}))
    env = {**_env(trace), "PYTHONPATH": os.pathsep.join([str(TRACER), str(root)])}
    done = subprocess.run([sys.executable, str(root / "drive.py"), str(trace)], env=env, capture_output=True,
                          text=True, timeout=WAIT_S)
    errors = [p.read_text() for p in trace.glob("errors-*")]
    assert done.returncode == 0 and not errors, (done.stderr, errors)
    chain = json.loads(next(trace.glob("target-*.json")).read_text())["chain"]
    assert [(m, f) for _, m, f in chain] == [
        ("ours_a/front.py", "Protocol.data_received"), ("ours_a/front.py", "handle"),
        ("ours_a/pool.py", "Runner.put"), ("ours_a/pool.py", "Runner._loop"),
        ("ours_b/work.py", "start"), ("ours_b/work.py", "relay"), ("ours_b/work.py", "worker"),
        ("ours_b/work.py", "compute")], chain
    assert [h.module for h in _hops(chain)] == ["ours_a/front.py", "ours_a/pool.py", "ours_b/work.py"]


@pytest.fixture(scope="module")
def measured(tiny_model_dir, tmp_path_factory) -> list[Hop]:
    chain, calls = _traced_forward_backward(tiny_model_dir, tmp_path_factory.mktemp("hops"))
    hops = _hops(_joined(chain, calls))
    print("forward_backward, measured:\n" + "\n".join(h.line(n) for n, h in enumerate(hops, 1)))
    return hops


def _page() -> tuple[int, list[tuple[str, str]]]:
    """The page's hop count and, per numbered line, its first `file:function` outside brackets."""
    section = PAGE.read_text().split("### `forward_backward`", 1)[1].split("\n### ", 1)[0]
    count = re.search(r"in \*\*(\d+) hops\*\*", section)
    assert count, "docs/architecture.md's forward_backward section states no '**N hops**'"
    named = []
    for line in re.findall(r"^\d+\. (.*)$", section, re.M):
        found = re.search(r"`([\w./]+\.py):([\w.<>]+)`", re.sub(r"\[[^\]]*\]", "", line))
        named.append(found.groups() if found else ("", line))
    return int(count.group(1)), named


def _names(hop: Hop, module: str, function: str) -> bool:
    same_module = hop.module == module or hop.module.endswith("/" + module)
    return same_module and any(f == function or f.endswith("." + function) or f.startswith(function + ".")
                               for f in hop.functions)


def test_the_measured_chain_runs_from_the_gateway_to_the_computation(measured):
    assert measured[0].module.startswith("gateway/"), measured[0]
    assert (measured[-1].module, measured[-1].functions[-1]) == COMPUTATION, measured[-1]
    crossings = [h for h in measured if h.crossing]
    assert len(crossings) == 1 and crossings[0].crossing.endswith("/ForwardBackward"), crossings


def test_the_architecture_page_lists_the_measured_hops(measured):
    count, named = _page()
    listing = "\n".join(h.line(n) for n, h in enumerate(measured, 1))
    assert count == len(measured) == len(named), \
        f"the page says {count} hops and numbers {len(named)} lines; measured {len(measured)}:\n{listing}"
    wrong = [f"{n}. page `{module}:{function}`, measured {hop.module} {hop.functions}"
             for n, (hop, (module, function)) in enumerate(zip(measured, named), 1)
             if not _names(hop, module, function)]
    assert not wrong, "\n".join(wrong) + f"\nmeasured:\n{listing}"


def test_forward_backward_reaches_the_computation_in_at_most_twelve_hops(measured):
    assert len(measured) <= GOAL, "\n".join(h.line(n) for n, h in enumerate(measured, 1))
