"""Packs what a bare GPU host lacks for scripts/gpu-check.sh, from this checkout's venv.

A GPU host with torch, transformers and PEFT but no network (the lent GPU machines: Python
3.12, torch 2.11+cu130) still lacks DeepSpeed, pydantic, grpcio at our version, FastAPI, the
tinker SDK and their needs. This writes, beside the repo, what gpu-check.sh installs from:
  .whl/        cp312 manylinux wheels of each missing distribution, at the version installed here
  .dev/site/   DeepSpeed's package and its metadata, copied (PyPI has no DeepSpeed wheel; it is
               pure Python until its ops are built, which tinkerd never asks for)
The distributions are tinkerd's own requirements (vLLM left out: too large, built for another
torch) and the tinker SDK's, with theirs, minus KEEP: what the host's image already has and is
too large to carry (torch and CUDA) or that tinkerd takes as it comes. Both folders are ignored
by git; name them in the device tool's `carry`. The whole must stay under its 64 MiB.

  .venv/bin/python scripts/gpu_bundle.py            # then: bash scripts/gpu-check.sh OUT
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, ".whl")
SITE = os.path.join(ROOT, ".dev", "site")
ROOTS = ["tinkerd", "tinker", "pytest-xdist"]
COPIED = {"deepspeed"}
# On the host's image already (docs/gpu.md): large, compiled against its torch, or any version does.
KEEP = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|numpy|transformers|tokenizers|safetensors|huggingface-hub|hf-xet|"
                  r"peft|accelerate|pytest|pluggy|iniconfig|execnet|sympy|mpmath|networkx|jinja2|markupsafe|filelock|"
                  r"fsspec|regex|pyyaml|tqdm|psutil|packaging|setuptools|pillow|ninja|einops|"
                  r"py-cpuinfo|requests|urllib3|certifi|idna|charset-normalizer|vllm.*)$")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
LIMIT_MIB = 60              # the device tool carries 64 MiB with the repo (~3 MiB)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed() -> dict[str, str]:
    """{distribution: version installed here} for ROOTS and everything they require (no extras
    but http2, which the SDK's httpx asks for), as a Python 3.12 Linux host would resolve it."""
    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    found, todo = {}, [Requirement(r) for r in ROOTS]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in found or KEEP.match(name):
            continue
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{name} is required but not installed in this venv: run scripts/setup.sh first")
        for line in metadata.requires(name) or []:
            sub = Requirement(line)
            extras = [{**env, "extra": e} for e in ("", *req.extras)]
            if sub.marker is None or any(sub.marker.evaluate(e) for e in extras):
                todo.append(sub)
    found.pop("tinkerd", None)      # the checkout itself travels
    return dict(sorted(found.items()))


def download(name: str, version: str) -> bool:
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "-d", WHEELS,
            f"{name}=={version}"]
    return subprocess.run(args, capture_output=True, text=True).returncode == 0


def copy_package(name: str) -> None:
    """The installed package's folders and its dist-info, without compiled caches."""
    dist = metadata.distribution(name)
    tops = {str(f).split("/")[0] for f in dist.files if not str(f).startswith("..")}
    for top in sorted(tops):
        source = os.path.join(str(dist.locate_file("")), top)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(SITE, top), dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def size_mib(*folders: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for top in folders for d, _, files in os.walk(top)
               for f in files) / 2**20


def main() -> None:
    shutil.rmtree(WHEELS, ignore_errors=True)
    shutil.rmtree(os.path.dirname(SITE), ignore_errors=True)
    os.makedirs(WHEELS), os.makedirs(SITE)
    missing = []
    for name, version in needed().items():
        if name in COPIED:
            copy_package(name)
        elif not download(name, version):
            missing.append(f"{name}=={version}")
    total = size_mib(WHEELS, SITE)
    print(f"{len(os.listdir(WHEELS))} wheels in .whl/, {', '.join(sorted(COPIED))} in .dev/site/: {total:.1f} MiB")
    if missing:
        sys.exit(f"no cp312 manylinux wheel found for: {', '.join(missing)}")
    if total > LIMIT_MIB:
        sys.exit(f"{total:.1f} MiB is over the {LIMIT_MIB} MiB the device tool can carry beside the repo")


if __name__ == "__main__":
    main()
