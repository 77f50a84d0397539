"""Shared fixtures: a tiny model built locally, a running `tinkerd up` on it, and empty databases."""

from __future__ import annotations

import contextlib
import os

import pytest

from harness.stack import running_stack

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_API_KEY", "tml-local-tests")
os.environ.setdefault("TINKER_TELEMETRY", "0")

# How pytest-xdist (scripts/test.sh: two workers) shares the tests out: in work units, each run
# whole on one worker, in collection order.
# - Test files that run vLLM or DeepSpeed inside the pytest process are one unit: both keep
#   process-wide torch.distributed state (vLLM tears its group down, DeepSpeed caches its groups),
#   so they run in collection order as in one process.
# - Every other file is one unit, so its module-scoped stack starts once.
# The units are made by the scheduler below. (xdist's own `--dist loadgroup` marks cannot do it
# under pytest 9: it appends the group to `item._nodeid`, which pytest 9's `nodeid` no longer
# reads, so every test became its own unit and module stacks restarted on both workers.)
IN_PROCESS_ENGINES = ("tests/sampler/", "tests/trainer/")
BENCH_SMOKE = "tests/bench/"        # one test, ~9 minutes here


def work_unit(nodeid: str) -> str:
    if nodeid.startswith(IN_PROCESS_ENGINES):
        return "in-process-engines"
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    """The longest units first, so the short ones fill the gaps at the end: the bench smoke test,
    the in-process engines, then collection order."""
    items.sort(key=lambda item: 0 if item.nodeid.startswith(BENCH_SMOKE) else
               1 if item.nodeid.startswith(IN_PROCESS_ENGINES) else 2)


def pytest_runtest_setup(item):
    """A test marked `tcmalloc` skips, saying why, where tcmalloc is not installed."""
    from tinkerd.process import tcmalloc_library
    if item.get_closest_marker("tcmalloc") and tcmalloc_library() is None:
        pytest.skip("libtcmalloc-minimal4 is not installed (scripts/setup.sh installs it)")


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:         # no pytest-xdist: one process, collection order
    pass
else:
    class _WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        config.option.loadscopereorder = False      # our order (above), not the most tests first
        return _WorkUnits(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from harness.models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path_factory):
    """An empty database of each kind the gateway runs on: SQLite in a file, and PostgreSQL 16
    (the `pgserver` wheel, harness/postgres.py; skipped where it is not installed)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db')}/tinkerd.db"
        return
    pytest.importorskip("pgserver")
    from harness.postgres import postgres

    with postgres(tmp_path_factory.mktemp("pg"), "tinkerd") as url:
        yield url


# Tests assert trainer = sampler exactly, which holds in float32: `--dtype auto` is bfloat16 on
# CPUs with AMX or AVX512-BF16 (and on GPUs), so every stack a test starts names its dtype, and
# bf16 is tested on its own terms (tests/trainer/test_bf16_training.py).
EXACT_DTYPE = ("--dtype", "float32")
# A CPU sampler zeroes its whole KV cache at start: the default 1 GiB costs ~3 s of CPU per
# engine on this 2-core VM, and the tiny model's longest batch (64 sequences x 1,024 tokens)
# needs 32 MiB of it.
TINY_KV_CACHE = ("--kv-cache-mib", "64")
TINY_KV_CACHE_MIB = int(TINY_KV_CACHE[1])


def exact_unless_named(flags: tuple[str, ...]) -> tuple[str, ...]:
    """`flags`, with `--dtype float32` added unless they name a dtype, and the tiny model's KV
    cache unless they size one."""
    flags = flags if "--dtype" in flags else (*flags, *EXACT_DTYPE)
    return flags if "--kv-cache-mib" in flags else (*flags, *TINY_KV_CACHE)


def stack_in_float32(model_dir: str, state, *flags: str):
    return running_stack(model_dir, state, *exact_unless_named(flags))


@pytest.fixture(scope="session")
def stack(tiny_model_dir, tmp_path_factory):
    """The shared `tinkerd up` on the tiny model, with default settings (in float32)."""
    # Dozens of test modules share it under one admin key: the per-user run and session limits are
    # raised for them.
    with stack_in_float32(tiny_model_dir, tmp_path_factory.mktemp("state"), "--alias", "tiny/alias-model",
                          "--alias", "Qwen/Qwen3.5-9B-Base", "--alias", "Qwen/Qwen3.5-4B",
                          "--max-models-per-user", "1000", "--max-sessions-per-user", "100000",
                          "--max-sampling-sessions-per-user", "100000") as s:
        yield s


@pytest.fixture(scope="session")
def start_stack():
    """For tests that need a stack with other settings: `with start_stack(model, state, *flags)`
    (float32 unless the flags name a dtype)."""
    return stack_in_float32


def sft_data(tok, texts):
    """One next-token datum per text (weights 1), as SDK types. Test modules import it:
    `from conftest import sft_data`."""
    from tinker import types

    out = []
    for text in texts:
        t = tok.encode(text)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                               loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)}))
    return out


def pytest_terminal_summary(terminalreporter):
    """The time budget per test file (setup + call + teardown, summed over its tests, on
    whichever worker ran them), longest first: a file that grows shows here at once."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                path = report.nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + getattr(report, "duration", 0.0)
    if not per_file:
        return
    terminalreporter.section("time per test file")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.1f} s  in all ({len(per_file)} files; "
                                f"with two workers the wall time is about half)")


def assert_reproducible_sampling(sampler, prompt) -> None:
    """What a user may rely on, in every dtype (issue 23): greedy (temperature 0) and top_k=1
    give n identical samples and the same tokens; a greedy request gives the same tokens alone or
    batched next to other requests; a fixed seed gives the same samples again."""
    from tinker import types

    def tokens(reply):
        return [tuple(s.tokens) for s in reply.sequences]
    greedy = tokens(sampler.sample(prompt, 8, types.SamplingParams(max_tokens=16, temperature=0.0)).result())
    top_1 = tokens(sampler.sample(prompt, 8, types.SamplingParams(max_tokens=16, temperature=1.0, top_k=1)).result())
    assert len(set(greedy)) == 1 and set(top_1) == set(greedy), (greedy, top_1)
    neighbours = [sampler.sample(types.ModelInput.from_ints([9 + i, 3, 4]), 2,
                                 types.SamplingParams(max_tokens=16, temperature=1.0, seed=i)) for i in range(6)]
    batched = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=16, temperature=0.0))
    for n in neighbours:
        n.result()
    assert tokens(batched.result()) == greedy[:1]
    seeded = [tokens(sampler.sample(prompt, 4, types.SamplingParams(max_tokens=16, temperature=1.0, seed=123))
                     .result()) for _ in range(2)]
    assert seeded[0] == seeded[1], seeded


def self_signed(directory, *, ca: bool = False) -> tuple[str, str]:
    """(cert.pem, key.pem) for localhost and 127.0.0.1, its own trust anchor: a leaf certificate
    (CA:FALSE), as rustls wants a server's to be, or with `ca` a CA certificate (what
    `openssl req -x509` makes by default)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tinkerd test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return str(cert_path), str(key_path)


def run_tinkerd(*argv: str, timeout: float = 120):
    """`tinkerd ARGV` (python -m launcher.cli, from the repo root, one OpenMP thread) run to its end:
    the CompletedProcess, its output captured as text. Test modules import it."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "launcher.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})


def start_trainer_process(model_dir: str, state_dir: str, *flags: str):
    """A real `tinkerd trainer` alone (no rank variables) on a free loopback port, once READY:
    (process, port); the caller stops it. Test modules import it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "trainer", "--base-model", model_dir,
                             "--listen", "127.0.0.1:0", "--state-dir", state_dir, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    port = next((int(line.split()[2]) for line in proc.stdout if line.startswith("READY trainer")), None)
    if port is None:
        proc.wait(timeout=30)
        pytest.fail("tinkerd trainer did not start:\n" + proc.stderr.read()[-3000:])
    return proc, port


_HOLD = """
import sys
from tinkerd import state_lock
state_lock.hold(sys.argv[1], sys.argv[2], sys.argv[3])
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def held_elsewhere(state_dir, name: str, holder: str):
    """Another process holding `name`'s state-dir lock (tinkerd/state_lock.py) on `state_dir` as
    `holder` until the block ends (or it is killed). Test modules import it."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(state_dir), name, holder], cwd=root,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
