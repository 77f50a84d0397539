"""The trainer as one job of W ranks (torchrun): rank 0 serves gRPC and leads, the others follow.

Every TrainerEngine call marked @collective runs on every rank, in the same order: rank 0 sends
the call -- the method's name and its arguments -- to the followers, then runs it itself; each
follower runs the same method on its own TrainerEngine. Commands travel over a gloo group of
their own, next to DeepSpeed's group (gloo on CPU, NCCL on GPU), as JSON plus raw tensor bytes:
never pickle, so a follower runs nothing but TrainerEngine's collective methods with plain data.
After each call the ranks compare how it ended (ok / user error); ranks that disagree have
diverged. A call that fails otherwise breaks the job at once on whichever rank it fails: the
others may be inside the call's collectives, which that rank can no longer pair, so it does not
wait to compare. Rank 0 pings the followers when idle, so a dead rank is noticed within seconds.
A rank that goes silent instead (its host cut off: no connection closes, and a collective would
wait out its timeout) is noticed by `watch`: every rank checks in with the job's store, rank 0
watches the followers' check-ins and each follower rank 0's, and one missing for `timeout_s`
breaks the job whatever its collectives are doing.

Who does what inside a call:
- forward_backward: the batch is split across ranks (balanced by tokens, `share`) and each rank's
  outputs are gathered to rank 0 (`gather_outputs`). Losses are sums; DeepSpeed averages
  gradients over ranks, so training.py scales each rank's loss by W first.
- files: rank 0 alone reads and writes a model's durable bookkeeping (journal, swaps, removal);
  a follower's `durable` answers "is it on disk" with rank 0's answer sent with the command.
  DeepSpeed's optimizer checkpoints are collective: every rank writes and reads its own
  partition, so with several hosts the state dir must be on a shared filesystem.

A broken job (a rank died, a collective failed, the ranks diverged): the call in flight fails
with UnavailableError (a `server` error), Health says not ready (and grpc.health.v1
NOT_SERVING, through `on_broken`), and rank 0 exits non-zero a moment later; the launcher then ends the job and `tinkerd up`'s supervisor restarts it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import threading
import time

import torch
import torch.distributed as dist

from tinkerd import dtypes
from tinkerd.errors import UnavailableError, UserError
from tinkerd.process import exit_now
from trainer_service.lora import LoraSpec
from trainer_service.training import AdamParams, DatumInput, DimuonParams

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0             # rank 0 pings idle followers this often
CHECK_INS = 5                 # a rank checks in with the store this often within its timeout
EXIT_AFTER_S = 1.0            # a broken rank 0 lingers this long, so the failing reply gets out
COMMAND_TIMEOUT = datetime.timedelta(minutes=30)   # the longest one call may take on a rank
_PING, _STOP = "_ping", "_stop"
_OK, _USER, _FAILED = 0, 1, 2
# What a command may carry besides JSON values and tensors.
_TYPES = {cls.__name__: cls for cls in (LoraSpec, AdamParams, DimuonParams, DatumInput)}


# ---- the wire form of a call: JSON + raw tensor bytes -------------------------------------------

def encode(method: str, args: tuple, kwargs: dict, on_disk: dict[str, bool]) -> torch.Tensor:
    """The call as one uint8 tensor: 8 bytes of JSON length, the JSON, then every tensor's bytes."""
    blobs: list[torch.Tensor] = []

    def enc(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            blobs.append(t.reshape(-1).view(torch.uint8))
            return {"$tensor": [str(t.dtype).removeprefix("torch."), list(t.shape)]}
        if dataclasses.is_dataclass(v) and _TYPES.get(type(v).__name__) is type(v):
            return {"$type": type(v).__name__, "fields": {f.name: enc(getattr(v, f.name))
                                                          for f in dataclasses.fields(v)}}
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {"$dict": {k: enc(x) for k, x in v.items()}}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"a command cannot carry {type(v).__name__}")

    header = json.dumps({"method": method, "args": enc(list(args)), "kwargs": enc(kwargs),
                         "on_disk": on_disk}).encode()
    size = torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([size, torch.frombuffer(bytearray(header), dtype=torch.uint8), *blobs])


def decode(buf: torch.Tensor) -> tuple[str, list, dict, dict[str, bool]]:
    n = int(buf[:8].view(torch.int64)[0])
    header = json.loads(bytes(buf[8:8 + n].numpy()))
    offset = 8 + n

    def dec(v):
        nonlocal offset
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "$tensor" in v:
            dtype, shape = dtypes.torch_dtype(v["$tensor"][0]), v["$tensor"][1]
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            t = buf[offset:offset + nbytes].clone().view(dtype).reshape(shape)
            offset += nbytes
            return t
        if "$type" in v:
            return _TYPES[v["$type"]](**{k: dec(x) for k, x in v["fields"].items()})
        return {k: dec(x) for k, x in v["$dict"].items()}

    return header["method"], dec(header["args"]), dec(header["kwargs"]), header["on_disk"]


# ---- the job --------------------------------------------------------------------------------

class Ranks:
    """This process's place in the job, and the command channel between rank 0 and the others."""

    def __init__(self, lock: threading.RLock):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.leader = self.rank == 0
        self.broken: str | None = None
        self.stopped = False                 # rank 0 told the followers to exit
        self.on_broken: list = []            # called with the reason when the job breaks (health)
        self.in_call = False                 # running a command's method (nested calls are not sent)
        self._on_disk: dict[str, bool] = {}  # a follower: rank 0's answers for the current command
        self._lock = lock                    # the engine's: one command at a time
        self._group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT) if self.world > 1 else None
        self._last_sent = time.monotonic()
        if self.leader and self.world > 1:
            threading.Thread(target=self._heartbeat, name="rank-heartbeat", daemon=True).start()

    # ---- rank 0 ---------------------------------------------------------------------------

    def lead(self, method: str, call, args: tuple = (), kwargs: dict | None = None,
             on_disk: dict[str, bool] | None = None):
        """Sends the call to the followers, runs it here, and checks every rank ended alike."""
        if self.broken:
            raise UnavailableError(f"the trainer job is broken ({self.broken}); it is being restarted")
        try:
            self._send(encode(method, args, kwargs or {}, on_disk or {}))
        except Exception as e:  # noqa: BLE001 - any failure to reach a rank breaks the job
            raise self._break(f"could not send {method} to the other ranks: {e}") from None
        status, error = _OK, None
        self.in_call = True
        try:
            result = call()
        except UserError as e:          # raised before any collective of the call, on every rank alike
            status, error = _USER, e
        except Exception as e:  # noqa: BLE001 - the followers may be inside the call's collectives
            raise self._break(f"{method} failed (rank 0 saw: {e})") from None
        finally:
            self.in_call = False
        try:
            agreed = self._outcomes_agree(status)
        except Exception as e:  # noqa: BLE001
            raise self._break(f"a rank failed during {method}: {error or e}") from None
        if not agreed:
            raise self._break(f"the ranks ended {method} differently (rank 0: {error or 'ok'})")
        if error is not None:
            raise error
        return result

    def stop(self) -> None:
        """Rank 0 is shutting down: lets the followers exit cleanly, then leaves the job. Waits
        for the call in flight (if any) for a while; after that the process just exits."""
        if not self.leader or self.broken or not self._lock.acquire(timeout=10):
            return
        try:
            if self.world > 1:
                self._send(encode(_STOP, (), {}, {}))
        except Exception:  # noqa: BLE001 - they are gone already
            pass
        finally:
            self.stopped = True          # under the lock: no call or heartbeat is sent after it
            _leave_job()
            self._lock.release()

    def _send(self, payload: torch.Tensor) -> None:
        dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), 0, group=self._group)
        dist.broadcast(payload, 0, group=self._group)
        self._last_sent = time.monotonic()

    def _break(self, reason: str) -> UnavailableError:
        """Marks the job broken and has this process exit non-zero shortly: the launcher ends the
        job, and a supervisor restarts it."""
        if not self.broken:
            self.broken = reason
            log.error("trainer job broken: %s; exiting in %.0f s", reason, EXIT_AFTER_S)
            for tell in self.on_broken:
                tell(reason)
            threading.Timer(EXIT_AFTER_S, exit_now, args=(1,)).start()
        return UnavailableError(f"the trainer job lost a rank or diverged ({reason}); it is being restarted")

    def watch(self, timeout_s: float) -> None:
        """Starts this rank's check-ins with the job's store (MASTER_ADDR:MASTER_PORT, the store the
        job was formed by): a peer whose check-ins stop for `timeout_s`, or a store that does not
        answer for as long, breaks the job. Rank 0 watches every follower, a follower rank 0. Not
        the collectives' timeout: a step may keep a rank waiting on another for longer than this."""
        if self.world > 1:
            threading.Thread(target=self._watch, args=(timeout_s,), name="rank-watchdog", daemon=True).start()

    def _watch(self, timeout_s: float) -> None:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            log.warning("rank %d: no MASTER_ADDR and MASTER_PORT (the job was not formed by a launcher): a rank "
                        "gone silent is noticed only by the collectives' timeout", self.rank)
            return
        prefix = f"tinkerd/check-ins/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        peers = range(1, self.world) if self.leader else [0]
        heard = {r: (0, time.monotonic()) for r in peers}     # check-ins seen, and since when
        store, answered, why = None, time.monotonic(), ""
        while not self.broken and not self.stopped:
            time.sleep(timeout_s / CHECK_INS)
            try:
                if store is None:
                    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=timeout_s / 2))
                store.add(prefix + str(self.rank), 1)
                counts = {r: store.add(prefix + str(r), 0) for r in peers}
            except Exception as e:  # noqa: BLE001 - unreachable, timed out: counted below
                store, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if (silent := time.monotonic() - answered) > timeout_s:
                    self._lost(f"the job's store at {host}:{port} has not answered for {silent:.0f} s "
                               f"(this host cut off from rank 0's? {why})")
                continue
            answered = time.monotonic()
            for r, count in counts.items():
                if count != heard[r][0]:
                    heard[r] = (count, answered)
                elif count and answered - heard[r][1] > timeout_s:     # 0: not started yet
                    self._lost(f"rank {r} has not checked in for {answered - heard[r][1]:.0f} s (its host cut "
                               f"off, or its process stuck)")

    def _lost(self, reason: str) -> None:
        if self.stopped:
            return
        if self.leader:
            self._break(reason)
        else:
            log.error("rank %d: %s; exiting", self.rank, reason)
            exit_now(1)

    def _heartbeat(self) -> None:
        while not self.broken and not self.stopped:
            time.sleep(HEARTBEAT_S / 2)
            if time.monotonic() - self._last_sent < HEARTBEAT_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self.broken and not self.stopped:
                    self.lead(_PING, lambda: None)
            except UnavailableError:
                pass                     # broken: logged, and the process is on its way out
            finally:
                self._lock.release()

    # ---- followers ------------------------------------------------------------------------

    def follow(self, engine) -> None:
        """A follower's life: run rank 0's commands on `engine` until told to stop. Losing rank 0,
        or ending a call differently from it, ends this process with a non-zero status."""
        if engine.durable is not None:
            engine.durable = FollowerDurable(engine.durable, self)
        while True:
            try:
                method, args, kwargs, self._on_disk = decode(self._receive())
            except Exception as e:  # noqa: BLE001
                log.error("rank %d lost rank 0 (%s); exiting", self.rank, e)
                exit_now(1)
            if method == _STOP:
                self.stopped = True
                _leave_job()
                return
            status = self._run(engine, method, args, kwargs)
            if status == _FAILED:
                # The other ranks may be inside the call's collectives (gather_outputs' send and
                # recv, ZeRO's reductions), which this rank can no longer pair: comparing outcomes
                # with them would wait out COMMAND_TIMEOUT. Leaving fails their calls at once.
                log.error("rank %d: %s failed; exiting", self.rank, method)
                exit_now(1)
            try:
                agreed = self._outcomes_agree(status)
            except Exception as e:  # noqa: BLE001
                log.error("rank %d: the job failed during %s (%s); exiting", self.rank, method, e)
                exit_now(1)
            if not agreed:
                log.error("rank %d ended %s differently from rank 0; exiting", self.rank, method)
                exit_now(1)

    def _run(self, engine, method: str, args: list, kwargs: dict) -> int:
        if method == _PING:
            return _OK
        fn = getattr(type(engine), method, None)
        if not getattr(fn, "collective", False):
            log.error("rank %d was sent %r, which is not a collective engine call", self.rank, method)
            return _FAILED
        self.in_call = True
        try:
            fn(engine, *args, **kwargs)
            return _OK
        except UserError:
            return _USER                 # rank 0 raises it too, and answers the caller
        except Exception:  # noqa: BLE001 - the job breaks: follow() exits
            log.exception("rank %d: %s failed", self.rank, method)
            return _FAILED
        finally:
            self.in_call = False

    def _receive(self) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self._group)
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self._group)
        return buf

    def on_disk_hint(self, model_id: str) -> bool:
        if model_id not in self._on_disk:
            raise RuntimeError(f"rank {self.rank} asked about {model_id!r}, which rank 0 did not answer for")
        return self._on_disk[model_id]

    # ---- inside a call, on every rank -------------------------------------------------------

    def _outcomes_agree(self, status: int) -> bool:
        both = torch.tensor([status, -status], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._group)
        return int(both[0]) == -int(both[1])

    def agree(self, value: str) -> str:
        """Rank 0's `value` on every rank (e.g. a temporary path rank 0 picked)."""
        if self.world == 1:
            return value
        buf = torch.frombuffer(bytearray(value.encode()), dtype=torch.uint8) if self.leader else None
        size = torch.tensor([buf.numel() if self.leader else 0], dtype=torch.int64)
        dist.broadcast(size, 0, group=self._group)
        if not self.leader:
            buf = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self._group)
        return value if self.leader else bytes(buf.numpy()).decode()

    def check_partitions(self, directory: str) -> None:
        """ZeRO's optimizer state is saved one partition per rank, and DeepSpeed loads it only
        into a job of as many ranks: refused here, alike on every rank, with what to do."""
        saved = {m.group(1) for name in (os.listdir(directory) if os.path.isdir(directory) else [])
                 if (m := re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt", name))}
        if saved and len(saved) != self.world:
            raise UserError(f"the optimizer state at {os.path.dirname(os.path.dirname(directory))} was written by "
                            f"a trainer of {len(saved)} ranks and this one runs {self.world}: load it without "
                            f"optimizer state, or run the trainer with {len(saved)} ranks")

    def share(self, data: list[DatumInput]) -> list[list[int]]:
        """Every rank's datums (indices into `data`), balanced by tokens: the datums in token
        order, cut into `world` runs of about equal tokens, so that datums sharing a prefix (an RL
        group's rollouts) stay on one rank and share it there (prefix_tree.py); at most
        world - 1 groups are cut. The same on every rank."""
        if self.world == 1:
            return [list(range(len(data)))]
        shares: list[list[int]] = [[] for _ in range(self.world)]
        total, load, r = sum(len(d.tokens) for d in data), 0, 0
        for i in sorted(range(len(data)), key=lambda i: data[i].tokens):
            n = len(data[i].tokens)
            if r < self.world - 1 and shares[r] and load + n / 2 > total * (r + 1) / self.world:
                r += 1         # this datum's middle would pass the rank's share: the next rank's
            shares[r].append(i)
            load += n
        return [sorted(s) for s in shares]

    def gather_outputs(self, data: list[DatumInput], shares: list[list[int]], outputs: list[dict],
                       metrics: dict[str, float]):
        """Rank 0 gets every datum's outputs in the batch's order and the metrics summed over
        ranks (forward_backward's metrics are sums); the others get theirs back."""
        if self.world == 1:
            return outputs, metrics
        keys = sorted(metrics)
        if not self.leader:
            flat = [torch.tensor([metrics[k] for k in keys], dtype=torch.float32)]
            flat += [o[name].float() for o in outputs for name in ("logprobs", "elementwise_loss")]
            dist.send(torch.cat(flat), 0, group=self._group)
            return outputs, metrics
        gathered: dict[int, dict] = dict(zip(shares[0], outputs))
        total = dict(metrics)
        for r in range(1, self.world):
            buf = torch.empty(len(keys) + 2 * sum(len(data[i].tokens) for i in shares[r]), dtype=torch.float32)
            dist.recv(buf, r, group=self._group)
            for k, v in zip(keys, buf[:len(keys)].tolist()):
                total[k] += v
            offset = len(keys)
            for i in shares[r]:
                n = len(data[i].tokens)
                gathered[i] = {"logprobs": buf[offset:offset + n], "elementwise_loss": buf[offset + n:offset + 2 * n]}
                offset += 2 * n
        return [gathered[i] for i in range(len(data))], total


class FollowerDurable:
    """A follower's view of the models' durable state: the same paths, rank 0's answer to "is it
    on disk", and no bookkeeping of its own (rank 0 keeps the journal and swaps directories)."""

    def __init__(self, durable, ranks: Ranks):
        self._durable, self._ranks = durable, ranks

    def state_path(self, model_id: str) -> str:
        return self._durable.state_path(model_id)

    def exists(self, model_id: str) -> bool:
        return self._ranks.on_disk_hint(model_id)

    def written(self, model_id: str) -> None:
        pass

    def trim(self, model_id: str, upto_seq: int) -> None:
        pass

    def remove(self, model_id: str) -> None:
        pass


def collective(method):
    """TrainerEngine methods that every rank runs: on rank 0 the outermost one is sent to the
    followers first (with whether its model is on disk, as rank 0 sees it); calls nested in it,
    and everything on a follower, just run."""
    name = method.__name__

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            ranks = self.ranks
            try:
                if ranks.world == 1 or ranks.in_call or not ranks.leader:
                    return method(self, *args, **kwargs)
                model_id = args[0] if args else kwargs.get("model_id")
                on_disk = {model_id: self.on_disk(model_id)} if isinstance(model_id, str) else {}
                return ranks.lead(name, lambda: method(self, *args, **kwargs), args, kwargs, on_disk)
            except Exception as e:
                if device_broken(e):      # the context is poisoned for every tenant: health says so, restart
                    raise ranks._break(f"a device error in {name}: {e}") from e
                raise
    run.collective = True
    return run


# What a CUDA context does not come back from (an out-of-memory error is not one of them).
_DEVICE_FATAL = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS_", "cudaError")


def device_broken(e: BaseException) -> bool:
    """Whether `e` leaves the device unusable for every later call in this process."""
    if type(e).__name__ == "AcceleratorError":
        return True
    return isinstance(e, RuntimeError) and any(marker in str(e) for marker in _DEVICE_FATAL)


def _leave_job() -> None:
    """The process groups destroyed, as torch asks of a process done with them. The process then
    ends without the interpreter's teardown (tinkerd.process.exit_now): left to it,
    gloo's leftovers are torn down during finalization and the process may abort (SIGABRT,
    "terminate called without an active exception"; about once in 12 clean 2-rank jobs, and
    still under load with the groups destroyed)."""
    if dist.is_initialized():
        dist.destroy_process_group()


