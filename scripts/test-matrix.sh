#!/usr/bin/env bash
# The transformers compatibility matrix: the core suite (`pytest -m core`, the files listed in tests/conftest.py)
# plus the PEFT LoRA tests on the oldest, one middle and the newest transformers release on the package index at the
# time of the run, within pyproject.toml's range (scripts/matrix_versions.py chooses them; not a hard-coded list).
# A version equal to the one the calling environment has installed is skipped: the whole suite has just run on it
# (README's full test command). One virtual environment per version, kept in .venv-matrix/ and reused while its
# requirements are unchanged. On 4.x (no built-in Qwen3.5) the references are this project's unpacked path and the
# pure-PyTorch model (tests/reference_model.py).
#
# Usage: scripts/test-matrix.sh [VERSION...]     (default: the three versions above)
# Each leg: pip install torch==2.13.0 (the local CPU wheel) transformers==VERSION peft==0.21.0 (4.x: also
# trl==1.16.0) -e ".[test]", then the core suite, then tests/integrations/test_lora.py. Prints the time of every leg; exits 1 if
# any leg failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
versions=("$@")
calling_version=$(python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true)
if [ ${#versions[@]} -eq 0 ]; then
    chosen_line=$(python scripts/matrix_versions.py) || { echo "could not list the transformers releases"; exit 1; }
    read -r -a chosen <<< "$chosen_line"
    echo "=== compatibility matrix: oldest, middle, newest release: ${chosen[*]}"
    for version in "${chosen[@]}"; do
        if [ "$version" = "$calling_version" ]; then
            echo "=== transformers $version: the calling environment's version, where the whole suite ran; not repeated"
        else
            versions+=("$version")
        fi
    done
fi
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
