"""The gateway's settings: the one place their defaults are written (flags derive from here)."""

from __future__ import annotations

import dataclasses

from tinkerd.settings import setting


@dataclasses.dataclass
class GatewaySettings:
    base_model: str = setting(help="local directory of the base model (also its tokenizer)")
    trainer: str = setting(help="trainer gRPC address host:port")
    samplers: list[str] = setting(flag="sampler", help="sampler gRPC address host:port (repeat per replica)")
    aliases: list[str] = setting([], flag="alias", help="another accepted name for the base model (repeatable)")
    host: str = setting("127.0.0.1", help="HTTP listen address")
    port: int = setting(8000, help="HTTP port (0 picks a free one)")
    state_dir: str = setting("./state", help="database, checkpoints, snapshots and logs")
    db_url: str | None = setting(None, help="SQLAlchemy URL; default sqlite:///<state-dir>/tinkerd.db")
    session_timeout_s: float = setting(600.0, help="unload the models of sessions without a heartbeat "
                                                   "for this long (they reload on next use)")
    max_pending_samples: int = setting(4096, help="sample requests in flight beyond this get HTTP 429 "
                                                  "(the SDK backs off and resends)")
    stability_ttl_s: float = setting(3600.0, help="sampled sequences recorded for stable_reinforce are "
                                                  "dropped after this long unused")
    max_body_bytes: int = setting(32 << 20, help="larger request bodies get HTTP 413, zstd ones also once "
                                                 "inflated")
    # The sampler's setting of the same name (one `tinkerd up` flag): the gateway refuses a sample
    # that cannot fit before it reaches a replica.
    max_model_len: int = setting(1024, help="context length: prompt + max_tokens")

    @property
    def model_names(self) -> list[str]:
        return [self.base_model, *self.aliases]

    @property
    def database_url(self) -> str:
        import os
        return self.db_url or f"sqlite:///{os.path.join(self.state_dir, 'tinkerd.db')}"
