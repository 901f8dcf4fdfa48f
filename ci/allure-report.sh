#!/usr/bin/env bash
# Builds the single-file Allure report from allure-pytest results with the pinned Allure 3
# command line (ci/allure/package.json), keeping its history between runs.
#
#   ci/allure-report.sh RESULTS_DIR OUTPUT_DIR [HISTORY_FILE]
#
# HISTORY_FILE (default OUTPUT_DIR/../allure-history.jsonl) is read and extended: restore it
# from the previous run's artifacts before calling this, and save it afterwards.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
results="$(realpath "${1:?results dir}")"
output="$(realpath -m "${2:?output dir}")"
history="$(realpath -m "${3:-$output/../allure-history.jsonl}")"
[ -d "$results" ] || { echo "allure-report: no results folder $results (run pytest --alluredir)" >&2; exit 2; }
cd "$here/allure"
[ -x node_modules/.bin/allure ] || npm ci --no-audit --no-fund --silent
mkdir -p "$(dirname "$history")"
ALLURE_OUTPUT="$output" ALLURE_HISTORY="$history" ./node_modules/.bin/allure generate "$results"
ls "$output"/index.html >/dev/null
echo "allure report: $output/index.html (history: $history)"
