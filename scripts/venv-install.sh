#!/usr/bin/env bash
# venv-install.sh VENV [pip-install arguments...]: makes VENV if it is missing and installs into it.
# Client venvs for the tests (older SDKs, the cookbook) are made on every fresh CI machine; pip
# took ~3 min for each (resolution over the local indexes and unpacking torch), uv takes seconds.
# uv comes from the project venv's dev extra; it is given pip's own settings (find-links, indexes,
# constraints: where this machine keeps its local wheels) and, like pip, picks the best match over
# all indexes. Without uv, or if uv fails, pip does it.
# Both write bytecode at install (uv only with --compile-bytecode): with PYTHONDONTWRITEBYTECODE set, as
# on these machines, a venv without it compiles every module from source in every process (vLLM's
# ~2,800 modules cost the sampler 4 s of CPU per start; a whole `tinkerd up` 37 s of CPU, 17 s with it).
set -euo pipefail
VENV="$1"; shift
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
UV="${UV:-$ROOT/.venv/bin/uv}"
PY="$VENV/bin/python"

pip_setting() {   # the value pip would use for a setting, from PIP_* or pip's config files
  local env="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!env:-}" ]; then echo "${!env}"; return; fi
  python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | head -1
}

if [ -x "$UV" ]; then
  [ -x "$PY" ] || "$UV" venv -q --seed "$VENV"
  args=(--index-strategy unsafe-best-match)
  for link in $(pip_setting find-links); do args+=(--find-links "$link"); done
  for index in $(pip_setting extra-index-url); do args+=(--extra-index-url "$index"); done
  index="$(pip_setting index-url)"; [ -n "$index" ] && args+=(--index-url "$index")
  for c in $(pip_setting constraint); do [ -f "$c" ] && args+=(--constraint "$c"); done
  if "$UV" pip install -q --compile-bytecode --python "$PY" "${args[@]}" "$@"; then exit 0; fi
  echo "venv-install: uv failed; installing with pip" >&2
fi
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q "$@"
