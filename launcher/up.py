"""`tinkerd up`: trainer, sampler replicas and gateway as separate processes on this machine.

Its flags are the union of the three services' settings (each written once, in the service's
settings.py), less the addresses that `up` wires itself; each child's command line is derived
from its settings object, so a flag given to `up` always reaches every service that has it.

The state dir must be private (0700, made so if missing; gateway/storage/state_dir.py), and `up` and its
children write owner-only files (umask 077). Unless given --service-token-file, `up` makes a random service token per state dir
(`<state-dir>/service-token`, mode 0600) and hands its path to all three children: the gRPC
calls between them are authenticated by default.

Sampler replicas (`--sampler-replicas N`) join the gateway's pool the way a replica on another
host does: each is `tinkerd sampler --register-with <the gateway's internal URL>` and heart-beats
there (sampler_service/registration.py); the gateway gets no --sampler list. Since a replica's
engine takes longest to start, the gateway's ports are fixed before anything starts (free ones
when --port / --internal-port are 0), and the replicas start with the trainer.

Gateway processes (`--gateway-workers G`: gateway, gateway-2, ...) share --port (--reuse-port)
and the database; each has an internal listener of its own. One registration reaches every
gateway on the database, but every replica heart-beats at each, so it stays in the pool while one
of them restarts. The first starts alone (it makes or upgrades the database's schema), then the
others.

With --https-cert the gateway serves HTTPS on both its listeners; the replicas and `up`'s own
health checks verify it against that certificate (register_ca), at the address they reach it by
(--host, 127.0.0.1 for a wildcard): the certificate must name that address.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from gateway.server import check_listeners
from gateway.settings import GatewaySettings
from gateway.storage import state_dir
from launcher import gpus, keys
from sampler_service import server as sampler_server
from sampler_service.settings import SamplerSettings
from tinkerd import metrics, model_dir, process, settings, state_lock
from tinkerd.errors import StateDirError, UserError
from trainer_service.settings import TrainerSettings

CHILDREN = {"trainer": TrainerSettings, "sampler": SamplerSettings, "gateway": GatewaySettings}
# Settings `up` fills in itself: where the children find each other.
WIRED = {"trainer": ("listen", "metrics_port"),
         "sampler": ("listen", "register_with", "register_ca", "advertise_address", "metrics_port"),
         "gateway": ("trainer", "samplers", "reuse_port")}


@dataclasses.dataclass
class UpSettings:
    start_timeout: float = settings.setting(600.0, help="seconds the services may take to become ready", above=0)
    restart: bool = settings.setting(True, help="restart a service that dies (on its old port); --no-restart "
                                                "stops the stack and exits non-zero instead, for a supervisor "
                                                "such as systemd or Kubernetes to act")
    max_restarts: int = settings.setting(5, help="restarts of one service within 10 minutes before `up` gives "
                                                 "up and exits non-zero", at_least=0)
    trainer_ranks: int = settings.setting(1, help="run the trainer as one job of this many ranks on this host "
                                                  "(torchrun; rank 0 serves, the batch is split across ranks)",
                                          at_least=1)
    sampler_replicas: int = settings.setting(1, help="sampler processes (one vLLM engine each) on this host; each "
                                                     "registers with the gateway like a replica on another host",
                                             at_least=1)
    gateway_workers: int = settings.setting(1, help="gateway processes on this host, sharing --port (the kernel "
                                                    "spreads the connections among them) and the database, for "
                                                    "more requests a second than one process's Python serves; "
                                                    "each has an internal listener of its own (the first on "
                                                    "--internal-port)", at_least=1)
    metrics_port: int = settings.setting(0, help="Prometheus /metrics of the trainer (this port) and the sampler "
                                                 "(the next): 0 picks free ones, -1 turns them off; all targets, "
                                                 "the gateway's /metrics too, are listed in <state-dir>/"
                                                 "prometheus-targets.json (Prometheus file_sd_configs)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every child's settings once; a setting two services share (base model, dtype, LoRA rank
    limit) is one flag for both, so its default must agree between them."""
    added: dict[str, dataclasses.Field] = {}
    for name, cls in CHILDREN.items():
        shared = []
        for field in settings.fields(cls):
            if field.name in added:
                other = added[field.name]
                if settings.default_of(field) != settings.default_of(other):
                    raise AssertionError(f"{cls.__name__}.{field.name} and the setting of the same name "
                                         f"elsewhere have different defaults")
                shared.append(field.name)
            added.setdefault(field.name, field)
        settings.add_arguments(parser, cls, skip=(*WIRED[name], *shared))
    settings.add_arguments(parser, UpSettings)
    # Set by `up` itself: where its children go on the host's GPUs (launcher/gpus.py); the internal
    # ports of gateway processes 2..N.
    parser.set_defaults(placement=None, worker_internal_ports=None)


def kind_of(name: str) -> str:
    """A child's service: "sampler-2" is a sampler."""
    return name.split("-")[0]


def child_argv(args: argparse.Namespace, name: str, **wiring) -> list[str]:
    kind = kind_of(name)
    if "metrics_port" in WIRED[kind]:
        wiring.setdefault("metrics_port", metrics_port_of(args.metrics_port, name))
    return [kind, *settings.to_argv(settings.from_args(CHILDREN[kind], args, **wiring))]


def metrics_port_of(base: int, name: str) -> int:
    """0 (free ports) and -1 (off) pass on; a fixed N gives the trainer N, "sampler" N+1, "sampler-k" N+k."""
    if base <= 0 or name == "trainer":
        return base
    return base + (int(name.split("-")[1]) if "-" in name else 1)


def child_command(args: argparse.Namespace, name: str, **wiring) -> list[str]:
    """`tinkerd <service> ...`; the trainer of several ranks under torchrun (one job on this host)."""
    launcher = [sys.executable, "-m", "launcher.cli"]
    if name == "trainer" and args.trainer_ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={args.trainer_ranks}", "-m", "launcher.cli"]
    return [*launcher, *child_argv(args, name, **wiring)]


def _start(name: str, command: list[str], ready: dict, log_dir: str, env: dict[str, str]) -> subprocess.Popen:
    """Starts `command` with `env` added to ours; a reader thread records the port it prints as READY."""
    log = open(os.path.join(log_dir, f"{name}.log"), "ab")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                            env={**os.environ, **env} if env else None, preexec_fn=process.stop_with_parent())

    def read():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            parts = line.decode(errors="replace").split()
            if len(parts) == 3 and parts[0] in ("READY", "METRICS", "INTERNAL"):
                ready[name if parts[0] == "READY" else f"{name}.{parts[0].lower()}"] = int(parts[2])
                _write_targets(log_dir, ready)
    threading.Thread(target=read, daemon=True).start()
    return proc


_TARGETS_LOCK = threading.Lock()


def _write_targets(log_dir: str, ready: dict) -> None:
    """<state-dir>/prometheus-targets.json, for Prometheus' file_sd_configs: the gateway's internal
    listener and every child that printed `METRICS <name> <port>`, rewritten as they (re)start."""
    targets = [{"targets": [f"127.0.0.1:{port}"],
                "labels": {"service": kind_of(name.split(".")[0]), "process": name.split(".")[0]}}
               for name, port in sorted(ready.items()) if name.endswith((".metrics", ".internal"))]
    path = os.path.join(os.path.dirname(log_dir), "prometheus-targets.json")
    with _TARGETS_LOCK:                    # one reader thread per child
        with open(path + ".tmp", "w") as f:
            json.dump(targets, f, indent=1)
        os.replace(path + ".tmp", path)


def _wait_ready(procs: dict[str, subprocess.Popen], ready: dict, names: list[str], timeout_s: float,
                log_dir: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(n in ready for n in names):
        for n in names:
            if procs[n].poll() is not None:
                raise SystemExit(f"tinkerd: {n} exited with code {procs[n].returncode}; see {log_dir}/{n}.log")
        if time.monotonic() > deadline:
            raise SystemExit(f"tinkerd: {names} not ready after {timeout_s:.0f} s; see {log_dir}/")
        time.sleep(0.05)


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def gateway_names(args: argparse.Namespace) -> list[str]:
    """The gateway processes' names (and log files): gateway, gateway-2, ..., gateway-N."""
    return ["gateway", *(f"gateway-{i}" for i in range(2, args.gateway_workers + 1))]


def sampler_names(args: argparse.Namespace) -> list[str]:
    """The replicas' names (and log files): sampler, sampler-2, ..., sampler-N."""
    return ["sampler", *(f"sampler-{i}" for i in range(2, args.sampler_replicas + 1))]


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def scheme(args: argparse.Namespace) -> str:
    return "https" if args.https_cert else "http"


def gateway_url(args: argparse.Namespace, name: str = "gateway") -> str:
    """A gateway process's internal listener, where this host's replicas register (its port is
    fixed before anything starts)."""
    return f"{scheme(args)}://{_reachable(args.internal_host)}:{internal_port_of(args, name)}"


def internal_port_of(args: argparse.Namespace, name: str) -> int:
    """The first gateway process's internal port is --internal-port; the others' are free ones."""
    return args.internal_port if name == "gateway" else args.worker_internal_ports[name]


def client_context(args: argparse.Namespace):
    """`up`'s own calls to the gateway trust its certificate, as the replicas do."""
    from sampler_service.registration import client_context as context

    return context(args.https_cert) if args.https_cert else None


def _wiring(args: argparse.Namespace, name: str, ready: dict) -> dict:
    """The addresses a child is started with, and on a GPU host its share of its GPU
    (launcher/gpus.py); once the stack runs, a restarted child gets the port it had, so the
    others still find it."""
    if kind_of(name) == "gateway":
        return {"trainer": f"127.0.0.1:{ready['trainer']}", "samplers": [],
                "internal_port": internal_port_of(args, name), "reuse_port": args.gateway_workers > 1}
    wiring = {"listen": f"127.0.0.1:{ready[name]}"} if name in ready else {}
    if args.placement:
        wiring.update(args.placement.overrides(name))
    if kind_of(name) == "sampler":
        wiring["register_with"] = [gateway_url(args, g) for g in gateway_names(args)]    # each heart-beats
        wiring["register_ca"] = args.https_cert
    return wiring


def free_port() -> int:
    """A port nothing listens on now, for a service whose address is needed before it runs (the
    gateway: its replicas need its URL; tests/e2e/test_scale_out.py wires its services so).
    Taken below the kernel's ephemeral range, where no process binding port 0 meanwhile (the
    trainer's and sampler's listeners, torch.distributed's stores) can be given it: drawn from
    that range, it was (the gateway failed with "Address already in use"). Only a process that
    binds this very port can still take it; the gateway then fails to start, visibly."""
    low = _ephemeral_ports()[0]
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:          # that whole band is taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel picks a port-0 bind's port from (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _wait_pool(args: argparse.Namespace, url: str, procs: dict, log_dir: str) -> None:
    """Until healthz says every replica joined the pool and is live (and the rest is up)."""
    want = f"{args.sampler_replicas}/{args.sampler_replicas} ok"
    deadline = time.monotonic() + args.start_timeout
    body: dict = {}
    while body.get("status") != "ok" or body.get("samplers") != want:
        for name, p in procs.items():
            if p.poll() is not None:
                raise SystemExit(f"tinkerd: {name} exited with code {p.returncode}; see {log_dir}/{name}.log")
        if time.monotonic() > deadline:
            raise SystemExit(f"tinkerd: the stack is not healthy after {args.start_timeout:.0f} s ({body}); "
                             f"see {log_dir}/")
        try:
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=10, context=client_context(args)) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:        # 503 until the pool has seen a live replica
            body = json.load(e)
        time.sleep(0.2)


def _child_env(args: argparse.Namespace, name: str) -> dict[str, str]:
    return args.placement.env(name) if args.placement else {}


def _start_child(args: argparse.Namespace, name: str, procs: dict, ready: dict, log_dir: str,
                 port: int | None = None) -> None:
    """Starts `name`; `port`: the one it listens on (a restart keeps its old one), else its own."""
    wiring = _wiring(args, name, {**ready, name: port} if port else ready)
    procs[name] = _start(name, child_command(args, name, **wiring), ready, log_dir, _child_env(args, name))


def _start_all(args: argparse.Namespace, procs: dict, ready: dict, log_dir: str) -> str:
    """Trainer and sampler replicas start in parallel (on a shared GPU one after another, each
    once the one before is READY); the gateway once the trainer answers; the replicas register
    with it once their engines run. Returns its URL."""
    names = ["trainer", *sampler_names(args)]
    first, *later = args.placement.start_order(names) if args.placement else [names]
    for name in first:
        _start_child(args, name, procs, ready, log_dir)
    _wait_ready(procs, ready, ["trainer"], args.start_timeout, log_dir)
    first_gateway, *more_gateways = gateway_names(args)
    _start_child(args, first_gateway, procs, ready, log_dir)
    if more_gateways:         # once the first has made (or upgraded) the database's schema
        _wait_ready(procs, ready, [first_gateway], args.start_timeout, log_dir)
        for name in more_gateways:
            _start_child(args, name, procs, ready, log_dir)
    started = first
    for group in later:
        _wait_ready(procs, ready, started, args.start_timeout, log_dir)
        for name in group:
            _start_child(args, name, procs, ready, log_dir)
        started = group
    _wait_ready(procs, ready, names + gateway_names(args), args.start_timeout, log_dir)
    url = f"{scheme(args)}://{_reachable(args.host)}:{ready['gateway']}"
    _wait_pool(args, url, procs, log_dir)
    return url


class Supervisor:
    """Restarts a child that died, on its old port, at most `max_restarts` times in 10 minutes."""

    WINDOW_S = 600.0

    def __init__(self, args: argparse.Namespace, procs: dict, ready: dict, log_dir: str):
        self.args, self.procs, self.ready, self.log_dir = args, procs, ready, log_dir
        self.restarts: dict[str, list[float]] = {name: [] for name in procs}

    def check(self) -> None:
        """Raises SystemExit(1) when a dead child may not be restarted."""
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            print(f"tinkerd: {name} exited with code {p.returncode}", file=sys.stderr, flush=True)
            recent = [t for t in self.restarts[name] if time.monotonic() - t < self.WINDOW_S]
            if not self.args.restart or len(recent) >= self.args.max_restarts:
                why = "--no-restart" if not self.args.restart else f"{len(recent)} restarts in 10 minutes"
                print(f"tinkerd: not restarting {name} ({why}); stopping", file=sys.stderr, flush=True)
                raise SystemExit(1)
            self.restarts[name] = [*recent, time.monotonic()]
            _start_child(self.args, name, self.procs, self.ready, self.log_dir, port=self.ready.pop(name))
            _wait_ready(self.procs, self.ready, [name], self.args.start_timeout, self.log_dir)
            print(f"tinkerd: {name} restarted on port {self.ready[name]}", file=sys.stderr, flush=True)


def service_token_file(state_dir: str) -> str:
    """The state dir's service token file, made (random, readable by its owner only) if missing."""
    path = os.path.join(state_dir, "service-token")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path


def private_state_dir(args: argparse.Namespace) -> None:
    """The state dir made 0700, or refused (before anything starts) if its group or others may use
    it; everything the services write there is owner-only (umask 077, inherited by the children)."""
    os.umask(state_dir.PRIVATE_UMASK)
    try:
        state_lock.make_state_dir(args.state_dir)
        if args.private_state_dir:
            state_dir.check_private(args.state_dir, "the state dir", "700")
    except StateDirError as e:
        raise SystemExit(f"tinkerd: {e}") from None


def check_metrics_ports(args: argparse.Namespace) -> None:
    """A fixed --metrics-port (the trainer's; the replicas take the next ones) free now, not found
    taken by a service after it loaded its model."""
    for name in ["trainer", *sampler_names(args)]:
        port = metrics_port_of(args.metrics_port, name)
        if port > 0:
            try:
                metrics.check_port("127.0.0.1", port)
            except UserError as e:
                raise SystemExit(f"tinkerd: {e} (the trainer takes --metrics-port, sampler replica k the k-th "
                                 f"after it)") from None


def fix_gateway_ports(args: argparse.Namespace) -> None:
    """The gateway processes' ports, fixed before anything starts (the replicas need them): free
    ones for those not given, each internal listener a port of its own."""
    args.port = args.port or free_port()
    args.internal_port = args.internal_port or free_port()
    args.worker_internal_ports = {}
    for name in gateway_names(args)[1:]:
        taken = {args.port, args.internal_port, *args.worker_internal_ports.values()}
        while (port := free_port()) in taken:
            pass
        args.worker_internal_ports[name] = port


def claim_state_dir(args: argparse.Namespace) -> None:
    """This `up` alone on its state dir (tinkerd/state_lock.py), refused before anything starts if
    another `up` runs there, or a trainer an earlier one left running when it was killed."""
    try:
        state_lock.hold(args.state_dir, "up", f"`tinkerd up` serving {scheme(args)}://{_reachable(args.host)}:"
                                              f"{args.port}")
        state_lock.check_free(args.state_dir, "trainer")
    except StateDirError as e:
        raise SystemExit(f"tinkerd: {e}") from None


def up(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    sampler_server.check_flags_or_exit(args)        # not minutes later, in a log
    # One decision for both services, so trainer and sampler run the same dtype.
    args.dtype = process.service_dtype(args.dtype, args.allow_slow_dtype)
    args.base_model, args.state_dir = os.path.abspath(args.base_model), os.path.abspath(args.state_dir)
    try:
        model_dir.check(args.base_model)           # before anything is made: the state dir, a child
        args.placement = gpus.place(args, sampler_names(args))      # None on a host without GPUs
    except UserError as e:
        raise SystemExit(f"tinkerd: {e}") from None
    if args.placement:
        print(f"tinkerd: {args.placement.summary}", flush=True)
    check_listeners(settings.from_args(GatewaySettings, args, trainer="", samplers=[]))
    check_metrics_ports(args)
    private_state_dir(args)
    fix_gateway_ports(args)
    claim_state_dir(args)                   # before anything is written there
    log_dir = os.path.join(args.state_dir, "logs")
    os.makedirs(log_dir, mode=0o700, exist_ok=True)
    args.service_token_file = args.service_token_file or service_token_file(args.state_dir)
    procs: dict[str, subprocess.Popen] = {}

    unwind_on_stop_signals()
    code = 1
    try:
        api_key = keys.first_admin_key(args.state_dir, args.db_url, args.db_password_file) if args.auth else None
        # Written at once: a stack that fails to start must not lose the only copy of the key.
        key_file = keys.write_key_file(args.state_dir, api_key) if api_key else None
        ready: dict[str, int] = {}
        url = _start_all(args, procs, ready, log_dir)
        print(f"tinkerd ready at {url} in {time.monotonic() - t0:.1f} s (logs: {log_dir})", flush=True)
        print(f"internal listener: {gateway_url(args)} (replicas register there; /metrics; every service's "
              f"metrics in {args.state_dir}/prometheus-targets.json)", flush=True)
        if args.gateway_workers > 1:
            print(f"{args.gateway_workers} gateway processes share port {args.port} (their internal listeners: "
                  f"{', '.join(gateway_url(args, g) for g in gateway_names(args))})", flush=True)
        if key_file:
            print("the admin's API key is in its file (readable by you only; more keys with `tinkerd keys create "
                  "--user NAME`):", flush=True)
            print(f"export TINKER_API_KEY=$(cat {shlex.quote(key_file)})", flush=True)   # a shell line
        elif not args.auth:
            print("auth is OFF (--no-auth): every caller acts as the admin user", flush=True)
        print(f"TINKER_BASE_URL={url}", flush=True)
        supervisor = Supervisor(args, procs, ready, log_dir)
        while True:
            supervisor.check()
            time.sleep(0.5)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
        code = e.code if isinstance(e.code, int) else 1
    finally:
        _ignore_stop_signals()
        _stop_all(procs)
    raise SystemExit(code)


def unwind_on_stop_signals() -> None:
    """Ctrl-C and SIGTERM raise SystemExit wherever the main thread is; `up` stops the children
    once that has unwound. (Stopping them inside the handler, when the signal landed in a
    Popen.poll() that held its child's wait lock, waited 15 s per child for that lock.)"""
    def on_signal(*_):
        _ignore_stop_signals()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _ignore_stop_signals() -> None:
    """Once stopping, a second Ctrl-C or SIGTERM does not cut the children's shutdown short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
