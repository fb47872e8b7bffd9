#!/usr/bin/env bash
# A local tracing UI for the demo: Arize Phoenix on 127.0.0.1, receiving the gateway's OTLP spans.
#
#   deploy/tracing-ui.sh               install if needed, then run Phoenix in the foreground (Ctrl-C stops it)
#   deploy/tracing-ui.sh --background  install if needed, start Phoenix detached, wait until it answers
#   deploy/tracing-ui.sh --stop        stop a Phoenix started with --background
#   deploy/tracing-ui.sh --install     only create the environment
#
# Phoenix lives in its own virtual environment, .venv-phoenix (154 packages, none of them
# torch: it must not share .venv with the gateway, whose OpenTelemetry and pydantic pins it would
# move). Idempotent: once the stamp file holds the wanted version, nothing is installed again.
#
# Ports (loopback only): UI and OTLP over HTTP on 6006 (traces at http://127.0.0.1:6006/v1/traces),
# OTLP over gRPC on 4317. Spans are kept in SQLite under .cache/phoenix (gitignored); delete
# that folder to start empty.
#
# Environment: PHOENIX_VENV (default <repo>/.venv-phoenix), PHOENIX_VERSION (default 20.26.1),
# PHOENIX_PORT (6006), PHOENIX_GRPC_PORT (4317), PHOENIX_WORKING_DIR (<repo>/.cache/phoenix),
# PYTHON (python3, 3.11 here).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PHOENIX_VENV:-$repo_root/.venv-phoenix}"
version="${PHOENIX_VERSION:-20.26.1}"
python="${PYTHON:-python3}"
stamp="$venv/.complete"

export PHOENIX_HOST=127.0.0.1
export PHOENIX_PORT="${PHOENIX_PORT:-6006}"
export PHOENIX_GRPC_PORT="${PHOENIX_GRPC_PORT:-4317}"
export PHOENIX_WORKING_DIR="${PHOENIX_WORKING_DIR:-$repo_root/.cache/phoenix}"
# Phoenix reports anonymous usage by default; nothing here should call out.
export PHOENIX_TELEMETRY_ENABLED=false
export PIP_DISABLE_PIP_VERSION_CHECK=1

ui="http://127.0.0.1:$PHOENIX_PORT"
pidfile="$PHOENIX_WORKING_DIR/phoenix.pid"
logfile="$PHOENIX_WORKING_DIR/phoenix.log"

install() {
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$version" ]]; then
        return 0
    fi
    echo "creating the Phoenix environment in $venv (arize-phoenix==$version; about 1.5 minutes, ~850 MB)"
    if [[ ! -x "$venv/bin/python" ]]; then
        "$python" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q "arize-phoenix==$version"
    # Refuse to stamp an environment that cannot start the server.
    "$venv/bin/python" -c "import phoenix.server.main" || {
        echo "phoenix.server.main does not import; the environment is broken" >&2
        exit 1
    }
    echo "$version" >"$stamp"
}

running_pid() {
    [[ -f "$pidfile" ]] || return 1
    local pid
    pid="$(cat "$pidfile")"
    kill -0 "$pid" 2>/dev/null && echo "$pid"
}

wait_ready() {
    local pid="$1"
    for _ in $(seq 1 120); do
        if curl -fsS -o /dev/null "$ui/healthz" 2>/dev/null; then
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "Phoenix exited during start; see $logfile" >&2
            tail -n 20 "$logfile" >&2 || true
            return 1
        fi
        sleep 1
    done
    echo "Phoenix did not answer on $ui within 120 s; see $logfile" >&2
    return 1
}

usage() {
    cat <<EOF

Phoenix: UI at $ui  (OTLP/HTTP: $ui/v1/traces, OTLP/gRPC: 127.0.0.1:$PHOENIX_GRPC_PORT)

Run the demo with tracing, in another terminal:
  DEMO_TRACING=true make demo
(the demo policy exports to \${OTEL_EXPORTER_OTLP_ENDPOINT:-http://127.0.0.1:6006}; the gateway
appends /v1/traces). Any other policy: telemetry: {enabled: true, endpoint: $ui}
Then send requests to http://127.0.0.1:8080/v1 and open $ui (project "default").
EOF
}

case "${1:-}" in
    --install)
        install
        echo "Phoenix environment ready: $venv"
        ;;
    --stop)
        if pid="$(running_pid)"; then
            kill "$pid"
            for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            rm -f "$pidfile"
            echo "stopped Phoenix (pid $pid)"
        else
            echo "no Phoenix started by this script is running"
        fi
        ;;
    --background)
        install
        mkdir -p "$PHOENIX_WORKING_DIR"
        if pid="$(running_pid)"; then
            echo "Phoenix already running (pid $pid)"
        else
            nohup "$venv/bin/phoenix" serve >"$logfile" 2>&1 &
            pid=$!
            echo "$pid" >"$pidfile"
            wait_ready "$pid"
            echo "Phoenix started in the background (pid $pid, log $logfile); stop it with: $0 --stop"
        fi
        usage
        ;;
    "")
        install
        mkdir -p "$PHOENIX_WORKING_DIR"
        usage
        echo
        exec "$venv/bin/phoenix" serve
        ;;
    *)
        sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
