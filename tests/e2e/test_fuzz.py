"""Malformed requests over every route of a real `tinkerd up` (issue 12): wrong types, missing and
extra fields, huge values, NaN/inf, random bytes, bad protobuf and zstd bodies, traversal
strings. None may get a 5xx or hang, no accepted future may fail as a server error, the services
stay up, and the SDK's normal flow works afterwards. Seeded (TINKERD_FUZZ_SEED) and bounded in
time; it prints how many requests it sent, by status code."""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import json
import os
import random
import time
import urllib.parse
import uuid

import httpx
import numpy as np
import pytest
import zstandard

from gateway import tinker_wire_pb2 as tw
from gateway.listeners import is_internal_path
from gateway.routes import ROUTERS

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("TINKERD_FUZZ_SEED", "12"))
BUDGET_S = float(os.environ.get("TINKERD_FUZZ_SECONDS", "50"))
MAX_REQUESTS = 6000
TIMEOUT_S = 15.0            # per request: longer is a hang
FUTURES_BUDGET_S = 40.0
# Training seq_ids below this run at once: setup runs one request at this seq_id first, so the
# model's runner never waits for a gap (gateway/futures/store.py) behind a refused request's seq_id.
PRIME_SEQ = 2**30          # the SDK's seq_id is an int32

_NAN, _INF = float("nan"), float("inf")
EVIL = [None, True, False, 0, -1, 1, 3, 2**31, 2**53 + 1, 2**63, 2**64, -2**63 - 1, 10**40, 0.5, -0.0, 1e30,
        1e-320, _NAN, _INF, -_INF, "", " ", "x", "7", ".", "..", "../..", "../../../../etc/passwd", "a/b", "a\\b",
        "a\x00b", "\x00", "\ud800", "tinker://", "tinker://../weights/..", "tinker://a/weights/../../x",
        "x" * 5000, [], [1, 2], ["a", ""], [""], [-1], [10**30], [_NAN], {}, {"a": _NAN}, {"": None},
        [[[[[]]]]], {"a": {"b": {"c": [1e308, -1e308]}}}]
# Credentials that must never work: each request carrying one gets a 401.
BAD_KEYS = ["", "tml-", "tml-fuzz", "tml-0123456789abcdef-" + "A" * 43, "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln",
            "Bearer tml-x", "x" * 5000]
PUBLIC = ("/api/v1/healthz", "/files/")
DEEP = ("[" * 100_000 + "]" * 100_000).encode()
BIG_INT = ('{"seq_id": ' + "9" * 6000 + "}").encode()


def _zstd_bomb() -> bytes:
    """~2 KB that inflate to 64 MiB."""
    c = zstandard.ZstdCompressor(level=19)
    return c.compress(b"\0" * (64 << 20))


class Fuzzer:
    def __init__(self, rng: random.Random, ids: dict, base_model: str):
        self.rng, self.ids, self.base = rng, ids, base_model
        self.used_seq: set[int] = set()
        self.bomb = _zstd_bomb()

    # ---- values ----------------------------------------------------------------------------

    def seq(self) -> int:
        while True:
            s = self.rng.randrange(10, PRIME_SEQ)
            if s not in self.used_seq:
                self.used_seq.add(s)
                return s

    def value(self):
        if self.rng.random() < 0.25:
            return self.rng.choice(list(self.ids.values()))
        return copy.deepcopy(self.rng.choice(EVIL))     # later edits must not change EVIL itself

    def segment(self) -> str:
        s = str(self.value())
        return urllib.parse.quote(s, safe="" if self.rng.random() < 0.7 else "/", errors="surrogatepass")

    def mutate(self, body):
        """One to three edits anywhere in a JSON body: set a field to a bad value, drop it, add one."""
        for _ in range(self.rng.randint(1, 3)):
            target = body
            while isinstance(target, dict) and target and self.rng.random() < 0.7:
                inner = [k for k, v in target.items() if isinstance(v, (dict, list)) and v]
                if not inner:
                    break
                nxt = target[self.rng.choice(inner)]
                target = nxt if isinstance(nxt, dict) else (nxt[0] if isinstance(nxt[0], dict) else target)
            if not isinstance(target, dict):
                continue
            op = self.rng.random()
            if op < 0.65 and target:
                target[self.rng.choice(list(target))] = self.value()
            elif op < 0.85 and target:
                del target[self.rng.choice(list(target))]
            else:
                target[self.rng.choice(["extra", "type", "x" * 50, "__proto__"])] = self.value()
        return body

    # ---- bodies ----------------------------------------------------------------------------

    def json_bodies(self) -> dict:
        i = self.ids
        adam = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                "grad_clip_norm": 0.0}
        return {
            "create_session": {"tags": ["fz"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"},
            "session_heartbeat": {"session_id": i["session"]},
            "create_model": {"session_id": i["session"], "model_seq_id": 1, "base_model": self.base,
                             "lora_config": {"rank": 4, "seed": 0, "train_attn": True, "train_mlp": True,
                                             "train_unembed": True}},
            "get_info": {"model_id": i["model"]},
            "optim_step": {"model_id": i["model"], "seq_id": self.seq(), "type": "optim_step",
                           "adam_params": dict(adam)},
            "save_weights_for_sampler": {"model_id": i["model"], "seq_id": self.seq(), "path": "fz-s",
                                         "sampling_session_seq_id": 1, "ttl_seconds": 3600},
            "save_weights": {"model_id": i["model"], "seq_id": self.seq(), "path": "fz-w", "overwrite": False,
                             "ttl_seconds": 3600, "user_metadata": {"a": 1}},
            "save_weights_external": {"model_id": i["model"], "seq_id": self.seq(), "path": "fz-e"},
            "load_weights": {"path": i["weights"], "optimizer": True, "session_id": i["session"],
                             "model_seq_id": 1, "seq_id": 0},
            "create_sampling_session": {"session_id": i["session"], "sampling_session_seq_id": 1,
                                        "base_model": self.base},
            "asample": {"sampling_session_id": i["sampler"], "seq_id": self.seq(), "num_samples": 1,
                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                            "seed": 1, "stop": ["\n"]},
                        "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0},
            "retrieve_future": {"request_id": uuid.uuid4().hex},
            "weights_info": {"tinker_path": i["weights"]},
            "copy_weights": {"source_path": i["sampler_weights"], "destination_project_id": "fz"},
            "ttl": {"ttl_seconds": 3600},
        }

    def raw_body(self, body) -> tuple[bytes, dict]:
        """A JSON body, or (one time in five) bytes that are not one."""
        if self.rng.random() < 0.8:
            return json.dumps(body).encode(), {"content-type": "application/json"}
        choice = self.rng.randrange(9)
        raw = [lambda: self.rng.randbytes(self.rng.randrange(0, 300)),
               lambda: b'{"session_id": "\xff\xfe\xc3", "model_id": "\xed\xa0\x80"}',
               lambda: DEEP, lambda: BIG_INT,
               lambda: self.rng.choice([b"[]", b"1", b'"x"', b"null", b"{", b'{"a":}', b"", b"NaN"]),
               lambda: json.dumps(body).encode()[:-3],
               lambda: zstandard.ZstdCompressor().compress(json.dumps(body).encode()),
               lambda: self.bomb,
               lambda: json.dumps({**body, "user_metadata": {"blob": "x" * (16 << 20)}}).encode()
               if self.rng.random() < 0.05 else b"{}"][choice]()
        ctype = self.rng.choice(["application/json", "application/json", "text/plain", "application/x-protobuf"])
        headers = {"content-type": ctype}
        if choice in (6, 7) or self.rng.random() < 0.1:
            headers["content-encoding"] = "zstd"
        return raw, headers

    def fwdbwd(self) -> tuple[bytes, dict]:
        msg = self._fwdbwd_message()
        body = msg.SerializeToString()
        headers = {"content-type": "application/x-protobuf"}
        r = self.rng.random()
        if r < 0.1:
            body = self.rng.randbytes(self.rng.randrange(1, 500))
        elif r < 0.15:
            body = body[:self.rng.randrange(len(body))]
        elif r < 0.2:
            body, headers["content-encoding"] = self.bomb, "zstd"
        elif r < 0.25:
            body, headers["content-encoding"] = self.rng.randbytes(64), "zstd"
        elif r < 0.5:
            body, headers["content-encoding"] = zstandard.ZstdCompressor().compress(body), "zstd"
        elif r < 0.53:
            headers["content-type"] = "application/json"
        return body, headers

    def _fwdbwd_message(self) -> tw.ForwardBackwardRequest:
        rng = self.rng
        msg = tw.ForwardBackwardRequest(model_id=self.ids["model"], seq_id=self.seq(),
                                        loss_fn=rng.choice(["cross_entropy"] * 4 + ["importance_sampling", "ppo",
                                                                                    "cispo", "nope", ""]))
        for _ in range(rng.choice([1, 1, 2, 3, 0])):
            n = rng.choice([2, 3, 5, 8])
            tokens = [rng.randrange(1, 200) for _ in range(n)]
            datum = msg.data.add()
            datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
            targets = datum.loss_fn_inputs["target_tokens"]
            targets.dtype, targets.dense = tw.DTYPE_INT64, np.asarray(tokens[1:] + [0], "<i8").tobytes()
            weights = datum.loss_fn_inputs["weights"]
            weights.dtype, weights.dense = tw.DTYPE_FLOAT32, np.ones(n, "<f4").tobytes()
            for key in ("logprobs", "advantages"):
                t = datum.loss_fn_inputs[key]
                t.dtype, t.dense = tw.DTYPE_FLOAT32, np.full(n, -0.5, "<f4").tobytes()
        if msg.data and rng.random() < 0.7:
            self._break_datum(msg, rng.choice(msg.data))
        return msg

    def _break_datum(self, msg: tw.ForwardBackwardRequest, datum: tw.Datum) -> None:
        rng = self.rng
        t = datum.loss_fn_inputs[rng.choice(list(datum.loss_fn_inputs))]
        edits = [
            lambda: setattr(datum.model_input[0].encoded_text, "tokens", b"\x01\x02\x03"),
            lambda: setattr(datum.model_input[0].encoded_text, "tokens",
                            np.asarray(rng.choice([[-1, 2], [10**9, 1], [5] * 5000]), "<i4").tobytes()),
            lambda: setattr(t, "dtype", rng.choice([77, -3, 2**30])),
            lambda: setattr(t, "dense", b"\x01\x02\x03\x04\x05"),
            lambda: t.shape.extend(rng.choice([[2**62, 2**62], [-1], [-1, -3], [0], [2**31, 0], [3, 1, 1, 1]])),
            lambda: t.sparse_csr.CopyFrom(tw.SparseCsr(crow_indices=np.asarray([0, 5, 1], "<i8").tobytes(),
                                                       col_indices=np.asarray([-7, 2**40], "<i8").tobytes(),
                                                       values=np.ones(2, "<f4").tobytes())),
            lambda: (t.ClearField("shape"), t.shape.extend([1, 2**40]),
                     t.sparse_csr.CopyFrom(tw.SparseCsr(crow_indices=np.asarray([0, 0], "<i8").tobytes()))),
            lambda: datum.model_input.add().image.SetInParent(),
            lambda: setattr(msg, "seq_id", rng.choice([-5, 2**31 - 1, 0])),
            lambda: msg.loss_fn_config.update({"clip_low_threshold": rng.choice([_NAN, _INF, -1e300])}),
            lambda: [msg.data.add().CopyFrom(datum) for _ in range(rng.choice([200, 5000]))],
            lambda: datum.ClearField("model_input"),
            lambda: datum.loss_fn_inputs.pop("target_tokens"),
            lambda: setattr(msg, "model_id", str(self.value())),
        ]
        try:
            rng.choice(edits)()
        except (ValueError, TypeError, AttributeError):
            pass        # the message type refused the edit itself: send what there is

    # ---- requests --------------------------------------------------------------------------

    def request(self, method: str, path: str, bodies: dict) -> tuple[str, str, bytes | None, dict]:
        """One malformed request for the route `method path`."""
        params = {name: self._path_value(name, method) for name in _params(path)}
        url = path
        for name, value in params.items():
            url = url.replace("{" + name + "}", value).replace("{" + name + ":path}", value)
        query = ""
        if method == "GET" and self.rng.random() < 0.5:
            query = "?" + urllib.parse.urlencode({"limit": self.value(), "offset": self.value()},
                                                 errors="surrogatepass")
        if method == "GET" or method == "DELETE":
            return method, url + query, None, {}
        if path.endswith("/forward_backward"):
            body, headers = self.fwdbwd()
            return method, url, body, headers
        key = "ttl" if path.endswith("/ttl") else path.rsplit("/", 1)[1]
        body = bodies.get(key, {})
        if self.rng.random() < 0.9:
            body = self.mutate(body)
        data, headers = self.raw_body(body)
        if key == "copy_weights":
            headers["x-idempotency-key"] = str(self.rng.randrange(50))
        return method, url, data, headers

    def credential(self, req: tuple) -> tuple[tuple, bool]:
        """Now and then the request with a missing, unknown or forged credential instead."""
        if self.rng.random() >= 0.05:
            return req, False
        method, url, body, headers = req
        return (method, url, body, {**headers, "X-API-Key": self.rng.choice(BAD_KEYS)}), True

    def _path_value(self, name: str, method: str) -> str:
        ids = self.ids
        real = {"run_id": ids["model"].replace(":", "%3A"), "session_id": ids["other_session"],
                "sampler_id": ids["sampler"], "name": "fz-e",
                "checkpoint_id": "weights/fz-d" if method == "DELETE" else self.rng.choice(
                    ["weights/fz-w", "external_weights/fz-e", "sampler_weights/fz-s"]),
                "relative": "adapter_config.json"}
        if self.rng.random() < 0.3 and name in real:
            return real[name]
        return self.segment() or "x"


def _params(path: str) -> list[str]:
    return [p.split(":")[0] for p in path.replace("}", "{").split("{")[1::2]]


# What a fuzz must not call: the key revoking itself (`tinker auth logout`) ends the run.
SKIPPED = {("DELETE", "/api/v1/auth/apikey/me")}


def _routes() -> list[tuple[str, str]]:
    out = []
    for router in ROUTERS:
        for route in router.routes:
            for method in sorted(route.methods - {"HEAD"}):
                if (method, route.path) not in SKIPPED:
                    out.append((method, route.path))
    return out


# ---- the test -----------------------------------------------------------------------------------

def _result(http: httpx.Client, request_id: str) -> httpx.Response:
    return http.post("/api/v1/retrieve_future", json={"request_id": request_id}, timeout=40)


def _ok(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(f"/api/v1/{path}", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    if "request_id" in out:
        done = _result(http, out["request_id"])
        assert done.status_code == 200, done.text
        return done.json()
    return out


def _setup(http: httpx.Client, base: str) -> dict:
    """Real ids the fuzz builds on: a session, a model with checkpoints, a sampling session."""
    session = _ok(http, "create_session", {"tags": ["fuzz"]})["session_id"]
    other = _ok(http, "create_session", {"tags": ["fuzz-other"]})["session_id"]
    model = _ok(http, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": base,
                                       "lora_config": {"rank": 4}})["model_id"]
    weights = _ok(http, "save_weights", {"model_id": model, "seq_id": 1, "path": "fz-w"})["path"]
    sampler_weights = _ok(http, "save_weights_for_sampler", {"model_id": model, "seq_id": 2, "path": "fz-s"})["path"]
    _ok(http, "save_weights_external", {"model_id": model, "seq_id": 3, "path": "fz-e"})
    keep = _ok(http, "save_weights", {"model_id": model, "seq_id": 4, "path": "fz-keep"})["path"]   # never named
    _ok(http, "save_weights", {"model_id": model, "seq_id": 5, "path": "fz-d"})                      # for DELETE
    _ok(http, "optim_step", {"model_id": model, "seq_id": PRIME_SEQ, "adam_params": {"learning_rate": 0.0}})
    sampler = _ok(http, "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "model_path": sampler_weights})["sampling_session_id"]
    return {"session": session, "other_session": other, "model": model, "weights": weights,
            "sampler_weights": sampler_weights, "sampler": sampler}, keep


def _send(http: httpx.Client, req, counts: collections.Counter) -> tuple[int | str, httpx.Response | None]:
    """The status, or why there is none. A kept-alive connection the server closed after an
    earlier answer (uvicorn does when a route answered without reading the whole body) is not
    this request's failure: it is sent once more on a new connection."""
    method, url, body, headers = req
    for attempt in range(2):
        try:
            r = http.request(method, url, content=body, headers=headers)
            return r.status_code, r
        except httpx.TimeoutException:
            return "timeout", None
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as e:
            if attempt:
                return f"transport:{type(e).__name__}", None
            counts["resent on a new connection"] += 1
        except httpx.TransportError as e:
            return f"transport:{type(e).__name__}", None


def _describe(req) -> str:
    method, url, body, headers = req
    return f"{method} {url[:150]} {headers} {body[:200] if body else body!r}"


def _fuzz(http: httpx.Client, fuzzer: Fuzzer) -> tuple[collections.Counter, list, list[str]]:
    routes, counts, failures, futures = _routes(), collections.Counter(), [], []
    deadline, n = time.monotonic() + BUDGET_S, 0
    while time.monotonic() < deadline and n < MAX_REQUESTS:
        bodies = fuzzer.json_bodies()
        for method, path in routes:
            req, bad_key = fuzzer.credential(fuzzer.request(method, path, bodies))
            status, r = _send(http, req, counts)
            n += 1
            counts[status] += 1
            if not isinstance(status, int) or status >= 500:
                failures.append(f"{status}: {_describe(req)} -> {r.text[:300] if r is not None else ''}")
            elif is_internal_path(path):      # the internal listener's (gateway/listeners.py): never here
                if status != 404:
                    failures.append(f"an internal route answered {status} on the public port: {_describe(req)}")
            elif bad_key and status != 401 and not path.startswith(PUBLIC):
                failures.append(f"a bad credential got {status}: {_describe(req)}")
            elif status == 200 and b'"request_id"' in r.content[:200]:
                futures.append((r.json()["request_id"], _describe(req)))
    return counts, failures, futures


def _check_futures(http: httpx.Client, futures: list) -> tuple[collections.Counter, list]:
    """Accepted requests: their futures must not fail as server errors."""
    outcome, failures = collections.Counter(), []
    deadline = time.monotonic() + FUTURES_BUDGET_S

    def one(item):
        if time.monotonic() > deadline:
            return "unchecked", item, None
        try:
            r = _result(http, item[0])
        except httpx.HTTPError as e:
            return f"transport:{type(e).__name__}", item, None
        if r.status_code == 408:
            return "pending", item, r
        category = r.json().get("category") if "json" in r.headers.get("content-type", "") else None
        return f"{r.status_code}:{category or 'ok'}", item, r

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for kind, item, r in pool.map(one, futures):
            outcome[kind] += 1
            if kind.startswith("5") or kind.endswith(":server") or kind.startswith("transport"):
                failures.append(f"future {kind}: {item[1]} -> {r.text[:300] if r is not None else ''}")
    return outcome, failures


def _sdk_flow(url: str, base: str, weights_path: str) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url)
    tc = service.create_lora_training_client(base_model=base, rank=4, seed=0)
    tokens = list(range(5, 30))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    out = tc.forward_backward([datum], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    seqs = sampler.sample(types.ModelInput.from_ints(tokens[:5]), 2,
                          types.SamplingParams(max_tokens=4, temperature=1.0)).result().sequences
    assert len(seqs) == 2 and all(len(s.tokens) >= 1 for s in seqs)
    loaded = service.create_training_client_from_state(weights_path)    # saved before the fuzz: undamaged
    assert np.isfinite(loaded.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
    rest = service.create_rest_client()
    assert rest.list_user_checkpoints().result().checkpoints


def _other_user(stack, base: str) -> tuple[str, dict, list[str]]:
    """Another user with work of their own, whose ids the fuzz also sends (they must stay 404s to
    the fuzzing user and the work untouched). Returns (their key, their ids, their checkpoints)."""
    import subprocess
    import sys

    key = subprocess.run([sys.executable, "-m", "launcher.cli", "keys", "create", "--user", "fuzz-victim",
                          "--state-dir", stack.state_dir], capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    with httpx.Client(base_url=stack.url, headers={"X-API-Key": key}, timeout=TIMEOUT_S) as http:
        ids, _ = _setup(http, base)
        return key, ids, _checkpoints(http)


def _checkpoints(http: httpx.Client) -> list[str]:
    r = http.get("/api/v1/checkpoints")
    assert r.status_code == 200, r.text
    return sorted(c["tinker_path"] for c in r.json()["checkpoints"])


def test_fuzz_every_route(stack, tiny_model_dir):
    victim_key, victim_ids, victim_checkpoints = _other_user(stack, tiny_model_dir)
    headers = {"X-API-Key": os.environ["TINKER_API_KEY"]}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=TIMEOUT_S) as http:
        ids, keep = _setup(http, tiny_model_dir)
        ids.update({f"victim_{name}": value for name, value in victim_ids.items()})
        t0 = time.monotonic()
        counts, failures, futures = _fuzz(http, Fuzzer(random.Random(SEED), ids, tiny_model_dir))
        elapsed = time.monotonic() - t0
        outcome, future_failures = _check_futures(http, futures)
        print(f"\nfuzz seed {SEED}: {sum(counts.values())} requests in {elapsed:.0f} s; by status "
              f"{dict(sorted(counts.items(), key=str))}; {len(futures)} accepted futures: {dict(outcome)}")
        for line in (failures + future_failures)[:40]:
            print("FAIL", line)
        assert http.get("/api/v1/healthz").status_code == 200
    with httpx.Client(base_url=stack.url, headers={"X-API-Key": victim_key}, timeout=TIMEOUT_S) as victim:
        assert _checkpoints(victim) == victim_checkpoints, "another user's fuzz changed this user's checkpoints"
    _sdk_flow(stack.url, tiny_model_dir, keep)
    assert not failures and not future_failures, f"{len(failures)} 5xx/hangs, {len(future_failures)} failed futures"
