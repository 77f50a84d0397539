"""Per-service credentials derived from the one shared service secret, and what each opens.

A deployment keeps one secret (`--service-token-file`). No service presents it: each presents
the token of its role for the service it calls, HMAC(secret, role and audience), and a server
accepts a role only for the methods that role needs (ALLOWED). A sampler's token cannot drive
the trainer's writes; a token sent to a sampler (perhaps a rogue address registered in the pool)
opens samplers only.

A process given the secret derives every token. A process given a role's credential file
(`python -m tinkerd.service_roles ROLE --secret-file F`) holds its own tokens and, for the
service it serves, only hashes of its callers' tokens: taking that process over yields that
role's power and nothing more.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import json
import sys

ROLES = ("gateway", "trainer", "sampler", "operator")
AUDIENCES = ("gateway", "trainer", "sampler")
CREDENTIAL_FORMAT = "tinkerd-service-credential/1"

# gRPC service name -> the audience whose tokens open it.
SERVICES = {"tinkerd.v1.Trainer": "trainer", "tinkerd.v1.Sampler": "sampler"}

ALL = "*"
REPLICA_ROUTES = frozenset({"/internal/v1/samplers/register", "/internal/v1/samplers/deregister",
                            "/internal/v1/samplers/list"})
# audience -> role -> the methods (gRPC: bare method names of the audience's service; gateway:
# internal paths) it may call. Methods of other services on a server (grpc.health.v1, reflection)
# only read, and every authenticated role may call them.
ALLOWED: dict[str, dict[str, frozenset[str] | str]] = {
    "trainer": {"gateway": ALL, "operator": ALL,
                "sampler": frozenset({"Health", "GetQueueState"}),
                "trainer": frozenset({"Health", "GetQueueState"})},
    "sampler": {"gateway": frozenset({"Sample", "Health"}), "trainer": frozenset({"ReceiveWeights", "Health"}),
                "operator": ALL, "sampler": frozenset({"Health"})},
    "gateway": {"sampler": REPLICA_ROUTES, "operator": REPLICA_ROUTES},
}


@functools.lru_cache(maxsize=64)        # a process derives the same few tokens on every call
def derive(secret: str, role: str, audience: str) -> str:
    """The bearer token `role` presents to `audience`; it names its role (so a refusal can)."""
    mac = hmac.new(secret.encode(), f"tinkerd service token\0{role}\0{audience}".encode(), hashlib.sha256)
    return f"{role}.{mac.hexdigest()}"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def audience_of(method: str) -> str:
    """The audience of a gRPC method path (/pkg.Service/Method), "" for other services'."""
    return SERVICES.get(method.lstrip("/").split("/", 1)[0], "")


def role_of(token: str) -> str:
    role = token.split(".", 1)[0]
    return role if role in ROLES and "." in token else ""


def allows(audience: str, role: str, method: str) -> bool:
    """Whether `role` may call `method` (a gRPC path, or a gateway internal path) on `audience`."""
    allowed = ALLOWED.get(audience, {}).get(role)
    if allowed is None:
        return False
    if allowed == ALL:
        return True
    if audience == "gateway":
        return method in allowed
    service, _, name = method.lstrip("/").partition("/")
    return service not in SERVICES or name in allowed


def opens(audience: str, role: str) -> str:
    """What `role` may call on `audience`, in words for a refusal."""
    allowed = ALLOWED.get(audience, {}).get(role)
    if not allowed:
        return "nothing"
    return "every method" if allowed == ALL else ", ".join(sorted(allowed))


def credential(secret: str, role: str) -> dict:
    """The credential file of `role`: its tokens for every audience, and digests of every role's
    tokens for its own service (ALLOWED says what each opens; the operator serves nothing)."""
    if role not in ROLES:
        raise ValueError(f"unknown service role {role!r}: one of {', '.join(ROLES)}")
    accept = {} if role == "operator" else {caller: digest(derive(secret, caller, role)) for caller in ROLES}
    return {"format": CREDENTIAL_FORMAT, "role": role,
            "send": {audience: derive(secret, role, audience) for audience in AUDIENCES}, "accept": accept}


def parse_credential(text: str) -> dict | None:
    """A credential file's content, or None when `text` is the shared secret itself."""
    if not text.lstrip().startswith("{"):
        return None
    data = json.loads(text)
    if data.get("format") != CREDENTIAL_FORMAT or data.get("role") not in ROLES:
        raise ValueError(f"not a {CREDENTIAL_FORMAT} file (make one with python -m tinkerd.service_roles)")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinkerd.service_roles",
                                     description="print a service role's credential file, derived from the "
                                                 "shared service secret (give it as that service's "
                                                 "--service-token-file)")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--secret-file", required=True, help="the shared service secret")
    args = parser.parse_args(argv)
    with open(args.secret_file) as f:
        secret = f.read().strip()
    if not secret or parse_credential(secret) is not None:
        raise SystemExit(f"{args.secret_file} does not hold the shared secret")
    json.dump(credential(secret, args.role), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
