#!/usr/bin/env bash
# Build .venv-litellm: the LiteLLM proxy, a benchmark-only peer for `python -m bench.overhead`.
#
# Idempotent: once the stamp file matches the pinned version, it does nothing.
# Plain `pip install 'litellm[proxy]==1.109.1'` cannot resolve here (it asks for a certifi and a
# litellm-proxy-extras newer than the registry carries), so uv installs it with an overrides
# file. proxy-extras only ships database migrations, which the proxy never runs without a
# database. uv compiles no bytecode and the machine sets PYTHONDONTWRITEBYTECODE, so the
# site-packages are compiled afterwards; without that LiteLLM starts in ~16 s and runs slower.
set -euo pipefail

LITELLM_VERSION="1.109.1"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LITELLM_VENV:-$ROOT/.venv-litellm}"
STAMP="$VENV/.litellm-env-stamp"
WANT="litellm[proxy]==$LITELLM_VERSION"
PYTHON="${PYTHON:-python3}"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "litellm-env: $VENV already holds $WANT"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
# uv lives inside the same venv: nothing is installed outside it.
"$VENV/bin/python" -m pip install --quiet --upgrade pip uv

OVERRIDES="$(mktemp)"
trap 'rm -f "$OVERRIDES"' EXIT
cat >"$OVERRIDES" <<'EOF'
certifi>=2026.10.18
litellm-proxy-extras==0.4.110
EOF

"$VENV/bin/uv" pip install --python "$VENV/bin/python" --override "$OVERRIDES" "$WANT"

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null || true

"$VENV/bin/litellm" --version >/dev/null 2>&1 || "$VENV/bin/python" -c 'import litellm.proxy.proxy_server'
echo "$WANT" >"$STAMP"
echo "litellm-env: ready in $VENV"
