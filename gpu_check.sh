#!/usr/bin/env bash
# The GPU path, exercised and measured in one command: the test suite, one paper-preset run for its 5,000
# iterations (timed), bench.py's runs-per-device table at the paper size, and a smoke sweep with JOBS twice
# the GPU count. It goes on after a failed step, so one failure does not lose the other measurements.
#
#   bash gpu_check.sh                      # on a GPU machine; logs and summary.txt in out/gpu_check/DATE/
#   SMALL=1 bash gpu_check.sh              # every step shrunk (smoke sizes, test_geometry.py): 1-2 min on CPU
#   STEPS="paper bench" bash gpu_check.sh  # some of the steps only
#
# Environment (default in brackets):
#   LOG         the folder for the logs and summary.txt, new or empty [out/gpu_check/DATE]
#   RUNS        the folder for the run folders, new or empty [$LOG/runs]
#   DATA_FILE   a UTF-8 text to train on ['': WikiText-103's 1.3 MB test split, --dataset=wikitext103-test,
#               fetched once into train.py's data_dir before the steps; a GPU node without network needs
#               wiki.test.raw put where train.py's message says, or DATA_FILE]
#   STEPS       any of: tests paper bench sweep [all four]
#   TESTS       pytest arguments [the whole suite; with SMALL=1, test_geometry.py]
#   STEP_TIMEOUT  seconds after which a step is stopped (then marked failed) [none]
#   PYTHON      the interpreter [python, else python3]
# sweep.sh's own variables (ANALYZE, ...) reach its two sweeps, except those this script sets.
for arg; do
    case $arg in
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg'; its settings are environment variables (bash gpu_check.sh" \
            "--help lists them)" >&2; exit 2 ;;
    esac
done
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SMALL=${SMALL:-0}
LOG=${LOG:-out/gpu_check/$(date +%Y%m%d-%H%M%S)}
RUNS=${RUNS:-$LOG/runs}
DATA_FILE=${DATA_FILE:-}
STEPS=${STEPS-tests paper bench sweep}
PYTHON=${PYTHON:-$(command -v python >/dev/null 2>&1 && echo python || echo python3)}
# the sizes of each step: sweep.sh's presets (the one place run sizes are written), shrunk with SMALL=1
if [ "$SMALL" = 1 ]; then
    TESTS=${TESTS-test_geometry.py} PRESET=smoke BENCH=(--jobs=1,2 --preset=smoke --iters=10)
    SWEEP_GRID=(DEPTHS=4 INITS='normal tied' SEEDS=1 CONTROL_SEEDS=)
else
    TESTS=${TESTS-} PRESET=paper BENCH=(--jobs=1,2,4,8 --preset=paper)
    SWEEP_GRID=()
fi

die() { echo "gpu_check.sh: $*" >&2; exit 2; }
case $SMALL in 0|1) ;; *) die "SMALL=$SMALL must be 0 or 1" ;; esac
for step in $STEPS; do
    case $step in
    tests|paper|bench|sweep) ;;
    *) die "unknown step '$step' in STEPS; use tests, paper, bench, sweep" ;;
    esac
done
if [ -n "$DATA_FILE" ] && ! { [ -f "$DATA_FILE" ] && [ -r "$DATA_FILE" ]; }; then
    what='does not exist'
    [ -d "$DATA_FILE" ] && what='is a folder'
    [ -e "$DATA_FILE" ] && [ ! -d "$DATA_FILE" ] && what='is not a readable regular file'
    die "DATA_FILE=$DATA_FILE $what; set it to a UTF-8 text file, or leave it empty for the WikiText-103 test split"
fi
TORCH=$("$PYTHON" -c 'import torch as t; n = t.cuda.device_count(); print(n, f"torch {t.__version__}, CUDA '\
'{t.version.cuda}, {n} GPUs")' 2>/dev/null) || die "cannot import torch with PYTHON=$PYTHON"
NGPU=${TORCH%% *}
[ "$NGPU" -gt 0 ] || [ "$SMALL" = 1 ] ||
    die "torch sees no CUDA GPU here, and the paper sizes would take hours on CPU; SMALL=1 checks every step on CPU"
for dir in "$LOG" "$RUNS"; do  # earlier measurements are never overwritten
    [ -z "$(ls -A "$dir" 2>/dev/null)" ] || die "$dir is not empty; give LOG (and RUNS) a new folder"
done
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
LOG=$(abs "$LOG") RUNS=$(abs "$RUNS")
[ -z "$DATA_FILE" ] || DATA_FILE=$(abs "$DATA_FILE")
cd "$REPO" || die "cannot enter $REPO"  # every step runs from the repository root, as its tests do
DATA_ARGS=(--data_file="$DATA_FILE") SWEEP_DATA=()
if [ -z "$DATA_FILE" ]; then  # fetched and encoded once here, not by each step
    DATA_ARGS=(--dataset=wikitext103-test) SWEEP_DATA=(--dataset=wikitext103-test)
    err=$("$PYTHON" -c 'import sys, train; train.prepare_data(train.get_config(sys.argv[1:]))' "${DATA_ARGS[@]}" \
          2>&1 >/dev/null) || { err=${err##*$'\n'}; die "no training text: ${err#error: }; or set DATA_FILE=PATH"; }
fi
mkdir -p "$LOG" "$RUNS" || die "cannot create $LOG and $RUNS"
export QKGEOM_GPU_CHECK=1  # the suite run here does not run this script again (test_devices.py)

# ----------------------------------------------------------------------------- helpers
say() { echo "$*" | tee -a "$LOG/summary.txt"; }
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f min", s / 60 }'; }
FAILED=0
run_step() {  # run_step NAME LOGFILE COMMAND...: its output to LOGFILE; sets STEP_S (seconds) and STEP_RC
    local name=$1 log=$LOG/$2 t0
    shift 2
    echo "---- $name: $*" | tee "$log"
    t0=$(date +%s)
    ${STEP_TIMEOUT:+timeout "$STEP_TIMEOUT"} "$@" >> "$log" 2>&1 < /dev/null
    STEP_RC=$? STEP_S=$(($(date +%s) - t0))
    if [ "$STEP_RC" != 0 ]; then
        FAILED=1
        say "$name: FAILED (exit $STEP_RC) after $(minutes "$STEP_S"); $log ends:"
        tail -n 5 "$log" | sed 's/^/    /' | tee -a "$LOG/summary.txt"
    fi
    return "$STEP_RC"
}
done_values() {  # done_values RUN_DIR KEY...: those values of the run's done.json, on one line
    "$PYTHON" -c 'import json, sys; d = json.load(open(sys.argv[1] + "/done.json"))
print(*(d[k] for k in sys.argv[2:]))' "$@"
}
sweep() {  # sweep NAME PRESET [VAR=VALUE...]: the command of a sweep into $RUNS/NAME, in SWEEP (timeout runs it)
    SWEEP=(env OUT="$RUNS/$1" PRESET="$2" DATA_FILE="$DATA_FILE" "${@:3}" bash "$REPO/sweep.sh"
           ${SWEEP_DATA[@]+"${SWEEP_DATA[@]}"})
}

# ----------------------------------------------------------------------------- the machine
{
    echo "${TORCH#* }"
    nvidia-smi 2>/dev/null || echo "no nvidia-smi; $(nproc 2>/dev/null || echo '?') CPU cores"
    git -C "$REPO" log -1 --format='commit %H' 2>/dev/null
} > "$LOG/machine.txt"
say "gpu_check.sh, $(date), SMALL=$SMALL, PRESET=$PRESET: $(head -n 1 "$LOG/machine.txt")"
[ "$NGPU" -gt 0 ] || say "no GPU: every step runs on CPU"
sweep dry "$PRESET" DRY_RUN=1
STUDY_N=$("${SWEEP[@]}" 2>/dev/null | sed -n '1s/.*, \([0-9]*\) runs .*/\1/p')  # a dry run writes nothing

# ----------------------------------------------------------------------------- the steps
step_tests() {
    run_step "1 tests" tests.log "$PYTHON" -m pytest -q -p no:cacheprovider $TESTS || return
    say "1 tests: ok in $(minutes "$STEP_S"): $(grep -E '(passed|failed)' "$LOG/tests.log" | tail -n 1)"
}
step_paper() {  # L6: the study's mean depth
    local run=$RUNS/paper/L6_normal_s1
    sweep paper "$PRESET" JOBS=1 ANALYZE=0 DEPTHS=6 INITS=normal SEEDS=1 CONTROL_SEEDS=
    run_step "2 paper run" paper.log "${SWEEP[@]}" || return
    local iters val_loss
    read -r PAPER_S iters val_loss < <(done_values "$run" wall_time iter val_loss)
    say "2 paper run $(basename "$run") (PRESET=$PRESET, $iters iterations): ok in $(minutes "$STEP_S") for the" \
        "whole process, $(minutes "$PAPER_S") training; val loss $val_loss"
}
step_bench() {
    run_step "3 bench" bench.log "$PYTHON" "$REPO/bench.py" "${BENCH[@]}" "${DATA_ARGS[@]}" || return
    # the table's rows: jobs, aggregate tok/s, ...; the speed-up of the best row over one process
    SPEEDUP=$(awk '$1 ~ /^[0-9]+$/ && NF >= 7 { if ($1 == 1) one = $2; if ($2 > best) { best = $2; k = $1 } }
                   END { if (one > 0) printf "%d %.2f", k, best / one }' "$LOG/bench.log")
    say "3 bench ${BENCH[*]}: ok in $(minutes "$STEP_S"); $(grep '^most tokens/s' "$LOG/bench.log")" \
        "(${SPEEDUP#* }x the tokens/s of one)"
}
step_sweep() {
    local jobs=$((2 * NGPU))
    [ "$jobs" -gt 0 ] || jobs=2
    sweep smoke smoke JOBS=$jobs ${SWEEP_GRID[@]+"${SWEEP_GRID[@]}"}
    run_step "4 smoke sweep" sweep.log "${SWEEP[@]}" || return
    say "4 smoke sweep, JOBS=$jobs ($NGPU GPUs): ok in $(minutes "$STEP_S"); $(grep '^sweep finished' "$LOG/sweep.log")"
}
for step in $STEPS; do "step_$step"; done

# ----------------------------------------------------------------------------- the estimate
if [ -n "${PAPER_S:-}" ] && [ -n "${SPEEDUP:-}" ] && [ -n "$STUDY_N" ]; then
    gpus=$NGPU where="$NGPU GPUs"
    [ "$gpus" -gt 0 ] || gpus=1 where='CPU'
    say "estimate: the whole $PRESET study ($STUDY_N runs) at ${SPEEDUP% *} runs at once per device on $where:" \
        "$(minutes "$(awk -v t="$PAPER_S" -v n="$STUDY_N" -v s="${SPEEDUP#* }" -v g="$gpus" \
                          'BEGIN { printf "%d", t * n / s / g }')") (every run timed as the L6 run, the study's" \
        "mean depth; the bench speed-up is at sweep.sh's preset size)"
fi
say "logs in $LOG/; run folders in $RUNS/"
exit $FAILED
