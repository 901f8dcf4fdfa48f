#!/usr/bin/env bash
# The PR gate, for any CI: install, run the suites at tier pr (operators and models), build
# the reports. Artifacts to upload afterwards: reports/pr/latest/ (drift.html, records.jsonl,
# drift.csv, summary.json) and reports/pr/allure-results/ (or the built allure-report/).
#
#   ci/pr-gate.sh [extra pytest arguments, e.g. --device cuda --candidates my_kernels]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install --quiet ${NUMALIGN_PIP_ARGS:--c constraints.txt} -e .
python3 -m pytest -n auto suites --tier pr -p no:cacheprovider \
    --report-dir reports/pr --alluredir reports/pr/allure-results "$@"
