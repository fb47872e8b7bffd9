#!/usr/bin/env bash
# Build .venv-portkey: the Portkey AI gateway (npm), a benchmark-only peer for
# `python -m bench.overhead` (the folder holds node_modules, not a Python venv; the name keeps
# it under .gitignore's .venv-*/ and `make clean`).
#
# Idempotent: once the stamp file matches the pinned versions, it does nothing.
# @hono/node-server is pinned through npm `overrides`: as resolved today (1.19.x) it answers
# every streamed request with a 500 (TypeError: immutable); 1.13.5 streams.
set -euo pipefail

PORTKEY_VERSION="1.15.2"
HONO_NODE_SERVER="1.13.5"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${PORTKEY_DIR:-$ROOT/.venv-portkey}"
STAMP="$DIR/.portkey-env-stamp"
WANT="@portkey-ai/gateway@$PORTKEY_VERSION @hono/node-server@$HONO_NODE_SERVER"
ENTRY="$DIR/node_modules/@portkey-ai/gateway/build/start-server.js"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -f "$ENTRY" ]]; then
    echo "portkey-env: $DIR already holds $WANT"
    exit 0
fi
command -v node >/dev/null || { echo "portkey-env: node is not installed (apt-get install nodejs npm)" >&2; exit 1; }
command -v npm >/dev/null || { echo "portkey-env: npm is not installed (apt-get install npm)" >&2; exit 1; }

mkdir -p "$DIR"
cat >"$DIR/package.json" <<JSON
{
  "name": "llm-gateway-bench-portkey",
  "private": true,
  "description": "The Portkey gateway as a benchmark peer of llm-gateway (bench/portkey-env.sh)",
  "dependencies": {"@portkey-ai/gateway": "$PORTKEY_VERSION"},
  "overrides": {"@hono/node-server": "$HONO_NODE_SERVER"}
}
JSON
npm install --prefix "$DIR" --no-audit --no-fund --omit=dev --loglevel=error

GOT="$(node -p "require('$DIR/node_modules/@hono/node-server/package.json').version")"
if [[ "$GOT" != "$HONO_NODE_SERVER" ]]; then
    echo "portkey-env: @hono/node-server resolved to $GOT, not $HONO_NODE_SERVER" >&2
    exit 1
fi
test -f "$ENTRY"
echo "$WANT" >"$STAMP"
echo "portkey-env: ready in $DIR (node $(node --version))"
