"""The chain of callers of a request inside one service process, from where it enters our code to
a target function, stitched across the hand-offs that cut a thread's stack: an asyncio task (its
creator's chain), a thread or an executor's work item (its starter's or submitter's chain), a
worker that ran before the request and was fed through a queue (the request's call into the
worker's module that handed it an object the worker holds), and a gRPC server call (a "crossing":
tests/e2e/test_request_hops.py pairs it with the client's call, in whichever process made it).

sitecustomize.py installs it at start-up; it records nothing until <dir>/go exists (what ran
before, the model's creation included, is no part of the request). It writes to <dir>:
  armed-<pid>        the window is open in this process
  calls-<pid>.jsonl  each gRPC client call: its method, when, and the chain that made it
  target-<pid>.json  the chain at the first call of the target (config.json names it)
  errors-<pid>.txt   what the tracer failed at
A chain is a list, outermost first, of ["frame", module, qualname] (our modules' frames only:
third-party frames are transparent) and ["crossing", method, time] (what comes before it is the
client's call of `method` made before `time`)."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread as cf_thread
import dataclasses
import dis
import itertools
import json
import os
import sys
import threading
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RESUME = dis.opmap.get("RESUME")
# Values that cannot tell one request's work from another's (interned or shared by everything).
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type, types.ModuleType)
_MAX_NESTING = 64


@dataclasses.dataclass
class Snapshot:
    seq: int
    time: float
    frames: list          # (module, qualname, {id: object} of its locals) of our frames, innermost first
    boundary: tuple       # ("handed", Handed) | ("grpc", method) | ("loop", None) | ("root", None)
    direct: bool = False  # at a loop or root: its outermost frame is ours (a task's coroutine, a thread's target)
    entered: object = None    # a call's own frame: what it holds later counts too (a caller waiting on a worker)


@dataclasses.dataclass
class Handed:
    snapshot: Snapshot    # the creator's / starter's / submitter's chain at the hand-off
    keep: object          # the handed object, alive so that its id stays its own


_state = types.SimpleNamespace(active=False, dir="", root=ROOT, ours=(), target=None, hit=False)
_seq = itertools.count()
_codes: dict = {}          # code object -> (kind, module, co_code)
_special: dict = {}        # code object -> kind, for the stdlib's hand-off and event-loop frames
_tasks: dict = {}          # id(coroutine frame) -> Handed, for tasks created in the window
_threads: dict = {}        # id(Thread) -> Handed
_work: dict = {}           # id(_WorkItem) -> Handed
_entries: list = []        # snapshots at each call into one of our modules from outside it
_write_lock = threading.Lock()


def install(directory: str) -> None:
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    _state.dir, _state.ours, _state.target = directory, tuple(config["ours"]), tuple(config["target"])
    _state.root = config.get("root", ROOT)        # where the `ours` packages are (the repository)
    loop = asyncio.base_events.BaseEventLoop
    for code in (asyncio.events.Handle._run.__code__, loop._run_once.__code__, loop.run_forever.__code__,
                 loop.run_until_complete.__code__, asyncio.runners.Runner.run.__code__):
        _special[code] = "loop"          # the event loop dispatching: what it runs was scheduled, not called
    for code in (threading.Thread.run.__code__, threading.Thread._bootstrap.__code__):
        _special[code] = "thread_machinery"
    _special[threading.Thread.start.__code__] = "thread_start"
    _special[threading.Thread._bootstrap_inner.__code__] = "thread_root"
    _special[cf_thread._WorkItem.__init__.__code__] = "work_new"
    _special[cf_thread._WorkItem.run.__code__] = "work_run"
    threading.Thread(target=_open_window, name="hop-trace-window", daemon=True).start()    # untraced itself
    threading.settrace(_hook)
    new_event_loop = asyncio.events.new_event_loop

    def traced_event_loop():
        """The thread that makes a loop runs it: traced from now, its tasks' creators recorded."""
        made = new_event_loop()
        made.set_task_factory(_task_factory)
        sys.settrace(_hook)
        return made
    asyncio.events.new_event_loop = asyncio.new_event_loop = traced_event_loop


def _open_window() -> None:
    go = os.path.join(_state.dir, "go")
    while not os.path.exists(go):
        time.sleep(0.02)
    _state.active = True
    _write(f"armed-{os.getpid()}", "")


def _write(name: str, text: str, append: bool = False) -> None:
    with _write_lock, open(os.path.join(_state.dir, name), "a" if append else "w") as f:
        f.write(text)


def _error(what: str) -> None:
    _write(f"errors-{os.getpid()}.txt", what + "\n", append=True)


def _kind(code) -> tuple:
    info = _codes.get(code)
    if info is None:
        info = _codes[code] = _classify(code)
    return info


def _classify(code) -> tuple:
    path = code.co_filename
    if path.startswith(_state.root + os.sep):
        module = path[len(_state.root) + 1:].replace(os.sep, "/")
        if module.split("/", 1)[0] in _state.ours:
            return "ours", module, code.co_code
    if code in _special:
        return _special[code], None, None
    parts = path.split(os.sep)
    if "grpc" in parts:
        server = parts[-1] == "_server.py"
        return ("grpc_server", None, None) if server else ("grpc_client", None, code.co_code)
    return "other", None, None


def _fresh(frame, co_code) -> bool:
    """A call, not a coroutine or generator resumed (3.11: RESUME's argument is 0 at a call)."""
    i = frame.f_lasti
    return RESUME is None or i < 0 or co_code[i] != RESUME or co_code[i + 1] == 0


def _hook(frame, event, arg):
    if not _state.active:
        return None
    try:
        _on_call(frame)
    except Exception:  # noqa: BLE001 - a tracer failure must not fail the request it watches
        _error(traceback.format_exc())
    return None


def _on_call(frame) -> None:
    kind, module, co_code = _kind(frame.f_code)
    if kind == "ours" and _fresh(frame, co_code):
        if (module, frame.f_code.co_name) == _state.target and not _state.hit:
            _state.hit = True
            _target(frame)
        if _caller_module(frame.f_back) != module:       # entered from another module, or handed here
            entry = _snapshot(frame)
            entry.entered = frame
            _entries.append(entry)
    elif kind in ("thread_start", "work_new"):
        handed = frame.f_locals["self"]
        (_threads if kind == "thread_start" else _work)[id(handed)] = Handed(_snapshot(frame.f_back), handed)
    elif kind == "grpc_client" and _fresh(frame, co_code):
        _client_call(frame)


def _caller_module(frame) -> str | None:
    """The nearest of our modules up this thread's stack, short of where it was handed this work."""
    while frame is not None:
        kind, module, _ = _kind(frame.f_code)
        if kind == "ours":
            return module
        if kind in ("loop", "thread_root", "work_run"):
            return None
        frame = frame.f_back
    return None


def _task_factory(loop, coro, context=None):
    if _state.active and getattr(coro, "cr_frame", None) is not None:
        _tasks[id(coro.cr_frame)] = Handed(_snapshot(sys._getframe(1)), coro.cr_frame)
    if context is None:
        return asyncio.Task(coro, loop=loop)
    return asyncio.Task(coro, loop=loop, context=context)


def _objects(frame) -> dict:
    return {id(v): v for k, v in frame.f_locals.items() if k not in ("self", "cls") and not isinstance(v, _SCALARS)}


def _handed(table: dict, frame) -> Handed | None:
    obj = frame.f_locals.get("self")
    handed = table.get(id(obj))
    return handed if handed is not None and handed.keep is obj else None


def _snapshot(frame) -> Snapshot:
    """This thread's chain from `frame` up to where this work was handed to it."""
    frames, boundary, outermost = [], ("root", None), ""
    while frame is not None:
        kind, module, _ = _kind(frame.f_code)
        if kind == "ours":
            frames.append((module, frame.f_code.co_qualname, _objects(frame)))
        task = _tasks.get(id(frame))
        if task is not None and task.keep is frame:      # a task's coroutine: its creator comes before it
            boundary = ("handed", task)
            break
        if kind == "loop":
            boundary = ("loop", None)
            break
        elif kind in ("thread_root", "work_run") and _handed(_threads if kind == "thread_root" else _work, frame):
            boundary = ("handed", _handed(_threads if kind == "thread_root" else _work, frame))
            break
        elif kind == "grpc_server" and frame.f_locals.get("rpc_event") is not None:
            boundary = ("grpc", _served_method(frame))
            break
        if kind not in ("thread_root", "thread_machinery"):
            outermost = kind
        frame = frame.f_back
    return Snapshot(next(_seq), time.monotonic(), frames, boundary, outermost == "ours")


def _served_method(frame) -> str:
    """The method of the call a grpc server frame serves: in the call's details, or (a registered
    method) its handler's name, up this thread's grpc frames or where the server's dispatch
    submitted the call to this thread."""
    while frame is not None:
        kind = _kind(frame.f_code)[0]
        if kind == "grpc_server":
            local = frame.f_locals
            method = getattr(getattr(local.get("rpc_event"), "call_details", None), "method", None)
            if not method and local.get("method_with_handler") is not None:
                method = local["method_with_handler"].name()
            if method:
                return _text(method)
        elif kind == "work_run":
            handed = _handed(_work, frame)
            return handed.snapshot.boundary[1] if handed and handed.snapshot.boundary[0] == "grpc" else ""
        frame = frame.f_back
    return ""


def _text(method) -> str:
    return method.decode() if isinstance(method, bytes) else method


def _instance_attr(obj, name: str):
    """`obj`'s own attribute, without running any __getattr__ of its class."""
    try:
        return object.__getattribute__(obj, "__dict__").get(name)
    except (AttributeError, TypeError):
        return None


def resolve(snapshot: Snapshot, depth: int = 0) -> list:
    if depth > _MAX_NESTING:
        raise RuntimeError(f"hand-offs nested deeper than {_MAX_NESTING}")
    ours = [["frame", module, qualname] for module, qualname, _ in reversed(snapshot.frames)]
    kind, payload = snapshot.boundary
    if kind == "handed":
        return resolve(payload.snapshot, depth + 1) + ours
    if kind == "grpc":
        return [["crossing", payload, snapshot.time]] + ours
    if not ours:            # the server framework's own context: the request enters our code below
        return []
    if not snapshot.direct:     # the framework (an event loop's I/O callback) called our first frame
        return ours
    return resolve(_feeder(snapshot), depth + 1) + ours


def _feeder(worker: Snapshot) -> Snapshot:
    """A worker that ran before the request (a thread's or a task's loop in our module M): the
    latest call into M, before this point, that handed it an object its frames in M hold: one
    of the call's arguments, or of its locals now (a caller still waiting for the worker)."""
    module = worker.frames[-1][0]
    held: dict = {}
    for frame_module, _, objects in reversed(worker.frames):
        if frame_module != module:
            break
        held.update(objects)
    for entry in reversed(list(_entries)):
        if entry.seq < worker.seq and entry.frames[0][0] == module and \
                (entry.frames[0][2].keys() | _objects(entry.entered).keys()) & held.keys():
            return entry
    outer = [f"{m}:{q}" for m, q, _ in reversed(worker.frames)]
    raise LookupError(f"a worker running since before the request ({' > '.join(outer)}) holds nothing that a call "
                      f"into {module} handed it in the window: a hand-off this tracer does not know")


def _target(frame) -> None:
    snapshot = _snapshot(frame)
    try:
        found = {"chain": resolve(snapshot)}
    except Exception as e:  # noqa: BLE001 - said in the file the test reads
        found = {"error": f"{type(e).__name__}: {e}"}
    _write(f"target-{os.getpid()}.json", json.dumps(found))


def _client_call(frame) -> None:
    local = frame.f_locals
    method = local.get("method")
    if not isinstance(method, (bytes, str)):
        method = _instance_attr(local.get("self"), "_method")
    if isinstance(method, (bytes, str)):
        snapshot = _snapshot(frame)
        record = {"method": _text(method), "time": snapshot.time, "chain": resolve(snapshot)}
        _write(f"calls-{os.getpid()}.jsonl", json.dumps(record) + "\n", append=True)
