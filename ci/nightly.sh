#!/usr/bin/env bash
# The nightly regression, for any CI: recapture the golden sets of changed models (previous
# versions kept), run every suite at tier nightly (this machine's shard with SHARD=i/n)
# against the previous nightly run, carry the history, fail on a regression; first, the honest
# operator candidates on reseeded inputs.
#
# Keep reports/nightly/ between runs (restore it from the previous run's artifacts first):
# its latest/ run is the baseline and history.jsonl the trend.
#
#   SHARD=1/2 ci/nightly.sh [--device cuda] [-- extra pytest arguments]
#
# Layer and model replay then run again through torch.compile (NUMALIGN_COMPILE, default
# inductor; NUMALIGN_COMPILE=none skips it) into reports/nightly/compiled/, against tonight's
# eager run (compiled against eager side by side in its drift.html). On the 2-core reference
# machine the compiled zoo adds tens of minutes to the night, most of it Inductor compiling
# (full-model replay alone: 19 of 27 zoo tests in 580 s at -n 2, cold; docs/measurements.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
report_dir="${NUMALIGN_NIGHTLY_DIR:-reports/nightly}${SHARD:+/shard-${SHARD/\//-of-}}"
extra=()
[ -n "${SHARD:-}" ] && extra+=(--shard "$SHARD")
compile=()
[ "${NUMALIGN_COMPILE:-inductor}" != "none" ] && compile=(--compile "${NUMALIGN_COMPILE:-inductor}")
# Honest candidates on freshly drawn inputs: each case of every family's operators, every
# candidate (the built-ins and tests/operators/honest_kernels.py), under 8 seeds it was not
# tuned on (tests/operators/test_reseeded.py; PR time samples eight operators, one seed).
NUMALIGN_RESEEDS="${NUMALIGN_RESEEDS:-8}" NUMALIGN_RESEED_ALL=1 python3 -m pytest -q \
    -p no:cacheprovider tests/operators/test_reseeded.py tests/operators/test_honest_reseeded.py
# The day-0 sweep (docs/sweep.md): a tiny checkpoint of every causal-LM type of the installed
# transformers, captured, replayed and planted, against the last night's table (new types and
# regressions printed; a regression fails the night). About 2 minutes a type on 2 CPU cores
# (114 s on average in docs/sweep.md: some 6 hours for the 196 types of transformers 5.24):
# NUMALIGN_SWEEP_LIMIT=N sweeps the first N, NUMALIGN_SWEEP=0 skips it.
if [ "${NUMALIGN_SWEEP:-1}" != "0" ] && [ -z "${SHARD:-}" ]; then
    sweep_dir="${NUMALIGN_NIGHTLY_DIR:-reports/nightly}/sweep"
    baseline=()
    if [ -f "$sweep_dir/sweep.csv" ]; then
        cp "$sweep_dir/sweep.csv" "$sweep_dir/previous.csv"
        baseline=(--baseline "$sweep_dir/previous.csv")
    fi
    limit=()
    [ -n "${NUMALIGN_SWEEP_LIMIT:-}" ] && limit=(--limit "$NUMALIGN_SWEEP_LIMIT")
    numalign zoo sweep --out "$sweep_dir" "${limit[@]}" "${baseline[@]}" --fail-on-regression
fi
exec numalign nightly --report-dir "$report_dir" --tier "${TIER:-nightly}" "${compile[@]}" "$@" \
    -- "${extra[@]}"
