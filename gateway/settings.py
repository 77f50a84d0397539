"""The gateway's settings: the one place their defaults are written (flags derive from here)."""

from __future__ import annotations

import dataclasses
import os

from tinkerd.errors import UserError
from tinkerd.rpc import ServiceAuthSettings
from tinkerd.settings import setting


@dataclasses.dataclass
class GatewaySettings(ServiceAuthSettings):
    base_model: str = setting(help="local directory of the base model (also its tokenizer)")
    trainer: str = setting(help="trainer gRPC address host:port")
    samplers: list[str] = setting([], flag="sampler", help="sampler gRPC address host:port (repeatable); replicas "
                                                          "may also join by themselves: tinkerd sampler --register-with")
    aliases: list[str] = setting([], flag="alias", help="another accepted name for the base model (repeatable)")
    host: str = setting("127.0.0.1", help="HTTP listen address")
    port: int = setting(8000, help="HTTP port (0 picks a free one)", at_least=0)
    reuse_port: bool = setting(False, help="share --port with the other gateway processes of this host on the same "
                                           "database (SO_REUSEPORT: the kernel spreads the connections among "
                                           "them); `tinkerd up --gateway-workers N` starts N so")
    # The internal listener: replicas joining the pool (/internal/) and Prometheus (/metrics), off
    # the users' port (gateway/listeners.py).
    internal_host: str = setting("127.0.0.1", help="listen address of the internal HTTP listener (/internal/: "
                                                   "sampler replicas register there with the service token; "
                                                   "/metrics); keep it off the users' network")
    internal_port: int = setting(0, help="port of the internal HTTP listener (0 picks a free one, printed as "
                                         "`INTERNAL gateway PORT`)", at_least=0)
    https_cert: str = setting("", help="PEM certificate (chain) to serve HTTPS with, on both listeners; not "
                                       "the gRPC --tls-cert")
    https_key: str = setting("", help="PEM private key of --https-cert")
    public_url: str = setting("", help="the URL clients reach this gateway at (e.g. https://tinker.example.com): "
                                       "the base of every URL it hands out (checkpoint downloads); default: "
                                       "the scheme and Host of each request")
    trusted_proxies: list[str] = setting([], flag="trusted-proxy", help="address or network (CIDR) of a reverse "
                                         "proxy whose X-Forwarded-Proto and X-Forwarded-Host are believed when "
                                         "--public-url is not given (repeatable)")
    state_dir: str = setting("./state", help="database, checkpoints, snapshots and logs")
    db_url: str | None = setting(None, help="SQLAlchemy URL; default $TINKERD_DB_URL, else "
                                            "sqlite:///<state-dir>/tinkerd.db (a password here is on the "
                                            "command line: use --db-password-file or the variable)")
    db_password_file: str = setting("", help="file holding the database password, put into the URL (keeps it "
                                             "off the command line)")
    signing_keys_file: str = setting("", help="the keys that sign JWTs and download URLs, newest first "
                                              "(gateway/identity/signing_keys.py; a mounted Secret, shared by every "
                                              "gateway); default <state-dir>/signing-keys, made on first start")
    private_state_dir: bool = setting(True, help="refuse to start unless the state dir is private to this user "
                                                 "(no group or other permission bits: chmod 700 DIR); "
                                                 "--no-private-state-dir for a volume whose access is controlled "
                                                 "outside, such as a Kubernetes volume with fsGroup")
    session_timeout_s: float = setting(600.0, help="unload the models of sessions without a heartbeat "
                                                   "or a request for this long (they reload on next use)", above=0)
    max_pending_samples: int = setting(4096, help="sample requests in flight beyond this get HTTP 429 "
                                                  "(the SDK backs off and resends)", at_least=1)
    auth: bool = setting(True, help="require an API key (tinkerd keys create) on every request; --no-auth makes "
                                    "every caller the one admin user, for local experiments only")
    token_ttl_s: float = setting(3600.0, help="lifetime of the JWTs the SDK exchanges its API key for", above=0)
    # Half the trainer's --max-resident-models (32) by default: one user cannot pin every slot.
    max_models_per_user: int = setting(16, help="training runs one user may have in open sessions, those being "
                                                "created included; keep it below the trainer's "
                                                "--max-resident-models", at_least=1)
    max_sessions_per_user: int = setting(256, help="sessions (ServiceClients) one user may have open", at_least=1)
    max_sampling_sessions_per_user: int = setting(1024, help="sampling sessions (create_sampling_session) one user "
                                                             "may have in open sessions", at_least=1)
    max_queued_per_user: int = setting(256, help="training requests one user may have queued (HTTP 429 beyond)",
                                       at_least=1)
    max_queued_mib_per_user: int = setting(1024, help="bytes of request one user's queued training requests may "
                                                      "hold, as stored and held in memory (MiB; HTTP 429 beyond)",
                                           at_least=1)
    max_samples_per_user: int = setting(1024, help="sample requests one user may have in flight (HTTP 429 beyond)",
                                        at_least=1)
    max_checkpoint_gb_per_user: float = setting(50.0, help="checkpoint bytes on disk one user may hold (GB)",
                                                at_least=0)
    stability_ttl_s: float = setting(3600.0, help="sampled sequences recorded for stable_reinforce are "
                                                  "dropped after this long unused", above=0)
    stability_mb_per_user: float = setting(256.0, help="sampled sequences recorded for stable_reinforce one user "
                                                       "may hold (MB; also at most 100000 of them): beyond it their "
                                                       "oldest are dropped", at_least=0)
    max_body_bytes: int = setting(32 << 20, help="larger request bodies get HTTP 413, zstd ones also once "
                                                 "inflated", at_least=1)
    # The trainer's setting of the same name (one `tinkerd up` flag): the gateway refuses such a
    # request before it is queued.
    max_batch_tokens: int = setting(1 << 17, help="a forward_backward's datums x its longest datum (the trainer "
                                                  "pads every datum to the longest; its memory grows with this "
                                                  "times the vocabulary): more is a 400", at_least=1)
    # The sampler's setting of the same name (one `tinkerd up` flag): the gateway refuses a sample
    # that cannot fit before it reaches a replica.
    max_model_len: int = setting(0, help="context length: prompt + max_tokens; 0: the model's own (config.json; "
                                         "a replica whose KV cache holds fewer tokens refuses beyond what it holds)",
                                 at_least=0)
    max_lora_rank: int = setting(64, help="the largest LoRA rank a model may have", at_least=1)
    sampler_wait_s: float = setting(60.0, help="how long a sample waits for a live sampler replica (the SDK "
                                               "keeps polling meanwhile) before it fails", at_least=0)
    future_lease_s: float = setting(10.0, help="a gateway renews its hold on the futures it runs every third of "
                                               "this; another gateway on the database re-drives the pending "
                                               "futures of one that stopped renewing for this long", above=0)
    closed_session_retention_s: float = setting(86400.0, help="a closed session whose runs hold no checkpoint is "
                                                              "deleted this long after it closed, with its runs "
                                                              "and sampling sessions", at_least=0)
    futures_retention_s: float = setting(86400.0, help="finished futures (with their results) are deleted this "
                                                       "long after they finished", above=0)
    snapshot_retention_s: float = setting(86400.0, help="an ephemeral sampler snapshot (save_weights_and_get_"
                                                        "sampling_client) is deleted, files and sampling "
                                                        "sessions, once none of its sampling sessions sampled "
                                                        "for this long and each of their sessions is closed or "
                                                        "stopped heart-beating; named checkpoints are kept", at_least=0)
    superseded_snapshot_retention_s: float = setting(
        3600.0, help="an ephemeral sampler snapshot of a model that has a newer one is deleted once none of "
                     "its sampling sessions sampled for this long, even while its session is live (an RL "
                     "loop leaves one behind per step); a model's newest snapshot is kept")
    # Off: a lone sample is 2 requests (asample, its retrieve_future) instead of 5 (3 polls of the
    # session besides), less CPU in the gateway and the client alike (docs/benchmarks.md#request_costs).
    sample_session_poll: bool = setting(False, help="tell the SDK (0.28 and later) to learn that its samples finished "
                                                    "by one retrieve_futures long-poll per sampling session, then "
                                                    "fetch each with retrieve_future, instead of one retrieve_future "
                                                    "long-poll per sample: fewer open connections while thousands of "
                                                    "samples are in flight, more requests and CPU for a lone sample; "
                                                    "retrieve_futures is served either way")
    fwdbwd_compression: str = setting("auto", choices=["auto", "on", "off"],
                                      help="whether the SDK zstd-compresses its forward_backward bodies: auto = "
                                           "not when it runs on this host (a loopback address and no proxy's "
                                           "forwarding header), where compressing costs CPU at both ends and "
                                           "saves no network; `on` behind a proxy or tunnel on this host that "
                                           "adds no forwarding header (ssh -L, kubectl port-forward, a TCP proxy)")
    # Above --max-pending-samples: each sample in flight holds its own long-poll by default.
    max_connections: int = setting(8192, help="open connections or requests in progress beyond this get HTTP "
                                              "503 at once (the SDK retries); one SDK client opens up to 1000, "
                                              "and each sample in flight holds one unless --sample-session-poll; "
                                              "the gateway raises its open-files limit to fit",
                                   at_least=1)
    keep_alive_timeout_s: int = setting(75, help="an idle kept-alive HTTP connection is closed after this long "
                                                 "(longer than a load balancer's usual 60 s, so it closes first)",
                                        at_least=1)
    header_timeout_s: float = setting(30.0, help="a connection whose request headers are not all in this long after "
                                                 "it connected or the request began is closed (slow clients; "
                                                 "looked at every this long, so cut within twice it)", above=0)
    event_loop: str = setting("auto", choices=["auto", "asyncio"], help="the event loop: auto is uvloop where "
                              "installed (less CPU per request), else asyncio's; asyncio for tools that follow "
                              "its Python frames (profilers, tracers, its debug mode)")
    trace_spans_per_session: int = setting(10_000, help="request spans kept per session for the console's "
                                                         "session panels and trace_export (the oldest go first)",
                                           at_least=0)
    trace_retention_s: float = setting(7 * 86400.0, help="request spans (trace_export, the session panels) are "
                                                         "deleted this long after their request finished", at_least=0)
    rpc_timeout_s: float = setting(3600.0, help="deadline of each call to the trainer or a sampler, queueing "
                                                "included; calls wait this long for a restarting service", above=0)
    # Unit prices for the usage report's cost estimates (gateway/billing.py); none given: costs are null.
    price_training_per_mtok: float | None = setting(None, help="USD per million tokens trained (forward_backward "
                                                               "and forward), for usage cost estimates", at_least=0)
    price_prefill_per_mtok: float | None = setting(None, help="USD per million prompt tokens prefilled while "
                                                              "sampling (prefix-cache hits are not told apart: "
                                                              "all prefill is counted uncached), for usage cost "
                                                              "estimates", at_least=0)
    price_sampled_per_mtok: float | None = setting(None, help="USD per million tokens sampled, for usage cost "
                                                              "estimates", at_least=0)
    price_storage_per_gb_month: float | None = setting(None, help="USD per GB-month (720 GB-hours, 10^9 bytes) of "
                                                                  "checkpoint storage, for usage cost estimates",
                                                       at_least=0)

    @property
    def model_names(self) -> list[str]:
        return [self.base_model, *self.aliases]

    def supported_base_model(self, name: str | None) -> str:
        """`name` if this server serves it (the base model's directory or an alias), else a user error."""
        if name not in self.model_names:
            raise UserError(f"base model {name!r} is not supported; this server serves {self.model_names}")
        return name

    @property
    def database_url(self) -> str:
        return database_url(self.state_dir, self.db_url, self.db_password_file)

    @property
    def https(self) -> bool:
        return bool(self.https_cert)

    @property
    def signing_keys_path(self) -> str:
        return self.signing_keys_file or os.path.join(os.path.abspath(self.state_dir), "signing-keys")


def database_url(state_dir: str, db_url: str | None, password_file: str = "") -> str:
    """--db-url, else $TINKERD_DB_URL (an environment variable is readable by the process's owner
    only; argv by everyone on the host), else SQLite in the state dir; the password from a file."""
    url = db_url or os.environ.get("TINKERD_DB_URL") or \
        f"sqlite:///{os.path.join(os.path.abspath(state_dir), 'tinkerd.db')}"
    if not password_file:
        return url
    import sqlalchemy

    from tinkerd.errors import UserError
    try:
        with open(password_file) as f:
            password = f.read().strip()
        return sqlalchemy.engine.make_url(url).set(password=password).render_as_string(hide_password=False)
    except OSError as e:
        raise UserError(f"--db-password-file {password_file}: {e.strerror}") from None
    except sqlalchemy.exc.ArgumentError:
        raise UserError("--db-url is not a database URL (not shown: it may hold a password); e.g. "
                        "postgresql+psycopg://USER@HOST/DB") from None
