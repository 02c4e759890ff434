#!/usr/bin/env bash
# A study's grid of train.py runs, then the analysis (README.md, Sweeps). Stop it at any time: the
# same command trains what is left. Arguments (--key=value, config files) go to every run and into
# its name. Environment [default], each checked before anything runs:
#   PRESET     paper | cpu | wide | ladder | length | optim | smoke [paper]    DRY_RUN  1 | 0 [0]
#   OUT        where the runs go [out/$PRESET]               BACKEND      local | slurm [local]
#   JOBS       runs at once [the visible GPUs, else CPU cores]   ARRAY_JOBS  under Slurm [16]
#   DATA_FILE  a UTF-8 text to train every run on [the preset's dataset]   PYTHON  [python3]
#   RUN_LIST   a file of runs instead of the grid, a line each: NAME --key=value ... (CRLF too)
#   ANALYZE    1 | 0: python analyze.py OUT at the end [1]   SBATCH_ARGS  extra sbatch options ['']
#   the grid: the variables in the loops below, with their defaults (set one to "" to leave it out)
usage() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}; /^# -* the grid/,/^case/p' "$0"; }  # --help
for arg; do case $arg in -h|--help) usage; exit 0 ;; esac; done
set -u
die() { echo "sweep.sh: $*" >&2; exit 2; }
check() {  # check PATTERN MESSAGE VARIABLE...: each variable that is set must match PATTERN
    for v in "${@:3}"; do [ -z "${!v+set}" ] || [[ ${!v} =~ $1 ]] || die "$v=${!v}: $2"; done
}
check . '"" is most likely a mistake: unset it for its default' OUT DATA_FILE RUN_LIST PYTHON
PRESET=${PRESET-paper} OUT=${OUT-out/$PRESET} BACKEND=${BACKEND-local} PYTHON=${PYTHON-python3}
check '^(local|slurm)$' 'use local or slurm' BACKEND
check '^[01]$' 'use 1 (yes) or 0 (no)' DRY_RUN ANALYZE PRINT_ARGS
check '^[1-9][0-9]*$' 'runs at once, a number >= 1' JOBS ARRAY_JOBS
check '^[[:space:][:digit:]]*$' 'whole numbers' WIDTHS CONTROL_WIDTH
check '^([[:space:][:digit:].]|[eE][-+]?)*$' 'numbers >= 0, separated by spaces' DEPTHS SEEDS \
      CONTROL_SEEDS LADDER_SEEDS LONG_ITERS LENGTHS DROPOUT_LENGTHS LENGTH_SEEDS SCAN_SEEDS \
      ARM_SEEDS SHRINK_TOS LRS ADAMW_LRS SGD_LRS OPTIM_SHRINK ADAMW_LR SGD_LR  # train.py: ranges
[ -z "${DATA_FILE-}" ] || [ -f "$DATA_FILE" ] || die "DATA_FILE=$DATA_FILE is not a file"
[[ $BACKEND = slurm && $OUT == *[#%]* ]] &&
    die "OUT=$OUT: Slurm reads # in #SBATCH lines as a comment, % as a pattern"
REPO=$(cd "$(dirname "$0")" && pwd) SWEEP_PY=("$PYTHON" "$REPO/plumbing/sweep.py")  # its Python
"${SWEEP_PY[@]}" check-env || exit 2  # a near miss of a variable above or below (DRYRUN, SEED)
# ----------------------------------------------------------------------------- presets
CPU=(--n_embd=64 --n_head=4 --block_size=64 --batch_size=16 --max_iters=2000 --eval_interval=200
     --geom_interval=200 --eval_iters=10 --shrink_iters=400 --dataset=wikitext103-test)
SLURM=(--cpus-per-task=1 --mem=4G --time=4:00:00)  # what a Slurm task asks for, if no preset says
case $PRESET in
paper)  ARGS=(--n_embd=384 --n_head=6 --block_size=256 --batch_size=64 --max_iters=5000
              --eval_interval=250 --geom_interval=250 --eval_iters=20 --shrink_iters=2000)
        SLURM=(--gres=gpu:1 --cpus-per-task=4 --mem=16G --time=4:00:00) ;;
cpu)    ARGS=("${CPU[@]}") SLURM=(--cpus-per-task=1 --mem=2G --time=1:00:00) ;;
ladder) ARGS=("${CPU[@]}" --n_layer=4 --qk_init=normal) ;;
length) ARGS=("${CPU[@]}" --n_layer=4 --n_embd=128 --qk_init=tied --decay_qk=False)
        SLURM[2]=--time=8:00:00 ;;
wide)   ARGS=("${CPU[@]}" --n_embd=128 --max_iters=4000 --shrink_iters=800) ;;
optim)  ARGS=("${CPU[@]}" --n_layer=4) SLURM=(--cpus-per-task=1 --mem=2G --time=1:00:00) ;;
smoke)  ARGS=(--n_embd=16 --n_head=2 --block_size=16 --batch_size=4 --max_iters=6 --warmup_iters=2
              --eval_interval=3 --geom_interval=3 --eval_iters=1 --eval_windows=2 --ckpt_interval=3
              --model_ckpts=3 --shrink_iters=4 --dataset=wikitext103-test)
        SLURM=(--cpus-per-task=1 --mem=1G --time=0:10:00) ;;
*)      die "unknown PRESET=$PRESET; use paper, cpu, wide, ladder, length, optim or smoke" ;;
esac
[ "${PRINT_ARGS-0}" = 1 ] && { echo "${ARGS[*]}"; exit 0; }  # the preset's sizes, for bench.py
[ -n "${DATA_FILE-}" ] && ARGS+=(--data_file="$DATA_FILE")
EXTRA=("$@")
case " $* " in *" --run_name="*|*" --out_dir="*)
    die "--run_name, --out_dir: sweep.sh names each run and puts it under OUT" ;; esac
# ----------------------------------------------------------------------------- the grid
GRID=()  # one line of --key=value settings per run; train.py names the run from all of them
add() { GRID+=("$*"); }
lr_args() { echo "--lr=$1 --min_lr=$(awk -v lr="$1" 'BEGIN {print lr / 10}')"; }  # min_lr: a tenth
study() {  # depth x qk_init x seed, then the control at depth 4 (its none runs are the study's)
    for seed in ${SEEDS-1 2 3 4}; do
        for depth in ${DEPTHS-4 6 8}; do
            for init in ${INITS-normal orthogonal tied}; do
                add --n_layer="$depth" --qk_init="$init" --seed="$seed"
            done
        done
    done
    controls "--n_layer=4 --qk_init=normal" "${CONTROL_SEEDS-1 2 3 4 5}" \
             "${SHRINK_TOS-0.2 0.14 0.1}"
}
controls() {  # controls ARGS SEEDS DOSES, per seed: none; per keep, shrink at each dose and freeze
    for seed in $2; do
        add $1 --seed="$seed"
        for keep in ${CONTROL_KEEPS-fro spec}; do
            for dose in $3; do
                add $1 --control=shrink --shrink_to="$dose" --control_keep="$keep" --seed="$seed"
            done
            add $1 --control=freeze --control_keep="$keep" --seed="$seed"
        done
    done
}
ladder() {  # width (4 heads up to head size 64, then heads of 64), length, lr; freeze at one width
    for seed in ${LADDER_SEEDS-1 2 3}; do
        for width in ${WIDTHS-32 64 128 256 384}; do
            size="--n_embd=$width --n_head=$(( width <= 256 ? 4 : width / 64 ))"
            add $size --seed="$seed"
            [ "$width" = "${CONTROL_WIDTH-256}" ] && controls "$size" "$seed" ""  # no dose: freeze
        done
        for iters in ${LONG_ITERS-8000}; do
            add --n_embd=128 --max_iters="$iters" --seed="$seed"
        done
        for lr in ${LRS-3e-4 3e-3}; do add $(lr_args "$lr") --seed="$seed"; done
    done
}
length() {  # how far training goes (the cosine schedule spans each length), the same with dropout
    for seed in ${LENGTH_SEEDS-1 2 3}; do
        for iters in ${LENGTHS-2000 4000 8000 16000}; do
            add --max_iters="$iters" --seed="$seed"
        done
        for iters in ${DROPOUT_LENGTHS-8000 16000}; do
            add --max_iters="$iters" --dropout=0.1 --seed="$seed"
        done
    done
}
optim() {  # the lr scan of each optimizer, the arms at the tuned lrs, the key control at AdamW's
    local sgd="--optimizer=sgd --weight_decay=0"  # SGD's coupled decay takes W_Q, W_K to zero here
    for seed in ${SCAN_SEEDS-1 2}; do
        for lr in ${ADAMW_LRS-1e-3 3e-3 1e-2 3e-2}; do add $(lr_args "$lr") --seed="$seed"; done
        for lr in ${SGD_LRS-0.1 0.3 1 3}; do add $sgd $(lr_args "$lr") --seed="$seed"; done
    done
    local a="$(lr_args "${ADAMW_LR-1e-2}")" s="$sgd $(lr_args "${SGD_LR-0.3}")"  # the tuned lrs
    for seed in ${ARM_SEEDS-1 2 3 4 5}; do
        for arm in "$a" "$a --decay_qk=False" "$a --qk_init=tied" "$s" "$s --qk_init=tied"; do
            add $arm --seed="$seed"
        done
    done
    controls "$a" "${ARM_SEEDS-1 2 3 4 5}" "${OPTIM_SHRINK-0.1}"
}
wide() {  # the control (its none arm is depth 4, normal init) first, then the study depth by depth
    controls "--n_layer=4 --qk_init=normal" "${CONTROL_SEEDS-1 2 3 4 5}" "${SHRINK_TOS-0.2 0.1}"
    for depth in ${DEPTHS-4 6 8}; do
        for init in ${INITS-normal orthogonal tied}; do
            for seed in ${SEEDS-1 2 3 4}; do
                add --n_layer="$depth" --qk_init="$init" --seed="$seed"
            done
        done
    done
}
case $PRESET in ladder) ladder ;; length) length ;; optim) optim ;; wide) wide ;; *) study ;; esac
if [ -n "${RUN_LIST-}" ]; then  # its lines instead of the grid's: NAME --key=value ... each
    lines=$("${SWEEP_PY[@]}" run-list "$RUN_LIST" "${#EXTRA[@]}") || exit 2  # ... --run_name=NAME
    [ -n "$lines" ] && mapfile -t GRID <<< "$lines" || GRID=()
fi
[ "${#GRID[@]}" -gt 0 ] || die "the grid is empty"
settings() { printf '%q ' "${ARGS[@]}" $1 ${EXTRA[@]+"${EXTRA[@]}"}; echo; }  # grid line $1's run
# train.py checks and names each line's run, through sweep.py, before anything runs
names=$(for line in "${GRID[@]}"; do settings "$line"; done |
        "${SWEEP_PY[@]}" names "$OUT" "${#ARGS[@]}" "${#EXTRA[@]}" "${RUN_LIST-}") || exit 2
NAMES=() RUNS=() TODO=()  # each run once; TODO: the runs not done yet, by their index
while read -r i name; do
    [ -f "$OUT/$name/done.json" ] || TODO+=(${#NAMES[@]}); NAMES+=("$name") RUNS+=("${GRID[$i]}")
done <<< "$names"
command_of() {  # command_of I: CMD, the train.py command of run I
    CMD=("$PYTHON" "$REPO/train.py" "${ARGS[@]}" ${RUNS[$1]} ${EXTRA[@]+"${EXTRA[@]}"}
         --out_dir="$OUT" --run_name="${NAMES[$1]}")
}
shown() { command_of "$1"; printf '%q ' "${CMD[@]}"; echo "--threads=$THREADS${2-}"; }  # one line
# ----------------------------------------------------------------------------- run them
if [ -n "${CUDA_VISIBLE_DEVICES-}" ]; then IFS=', ' read -ra GPUS <<< "$CUDA_VISIBLE_DEVICES"
else GPUS=($(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)); fi
NCPU=$(nproc 2>/dev/null || echo 1) JOBS=${JOBS-${#GPUS[@]}}
[ "$JOBS" -gt 0 ] || JOBS=$NCPU
THREADS=$(( NCPU / JOBS > 0 ? NCPU / JOBS : 1 ))
if [ "$BACKEND" = slurm ]; then  # an array task per run not done, read from this submission's files
    JOBS=${ARRAY_JOBS-16} THREADS='${SLURM_CPUS_PER_TASK:-1}' n=${#TODO[@]} dep=
    SUB=$OUT/slurm/$(date +%Y%m%d-%H%M%S)-$$
    TASKS=$(for i in ${TODO[@]+"${TODO[@]}"}; do  # a task whose run is done by then does nothing
        printf '[ -f %q ] || ' "$OUT/${NAMES[$i]}/done.json"
        shown "$i" " >> $(printf %q "$OUT/logs/${NAMES[$i]}.log") 2>&1"
    done)
    SBATCH=(--job-name="qkgeom-$PRESET" --array="0-$((n - 1))%$JOBS" --output="$SUB/%A_%a.out")
    SCRIPT=$(echo '#!/usr/bin/env bash'
             printf '#SBATCH %q\n' "${SBATCH[@]}" "${SLURM[@]}"
             printf 'eval "$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" %q)"\n' "$SUB/commands.txt")
fi
[ "${DRY_RUN-0}" = 1 ] || { mkdir -p "$OUT/logs" 2> /dev/null && [ -w "$OUT/logs" ]; } ||
    die "OUT=$OUT: cannot write $OUT/logs"
echo "sweep: PRESET=$PRESET, ${#NAMES[@]} runs in $OUT ($((${#NAMES[@]} - ${#TODO[@]})) finished," \
     "${#TODO[@]} to train), JOBS=$JOBS, --threads=$THREADS each"
if [ "${DRY_RUN-0}" = 1 ] && [ "$BACKEND" = slurm ]; then  # what would run, and nothing written
    printf '%s\n' "# $SUB/array.sbatch:" "$SCRIPT" "# $SUB/commands.txt:" "$TASKS"; exit 0
elif [ "${DRY_RUN-0}" = 1 ]; then
    for i in ${TODO[@]+"${TODO[@]}"}; do shown "$i"; done; exit 0
fi
rm -f "$OUT"/logs/*.failed
"${SWEEP_PY[@]}" prepare "${ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"} ||
    die "cannot prepare the data (nothing ran)"
if [ "$BACKEND" = slurm ]; then  # the array, then the analysis after all of its tasks
    if [ "$n" -gt 0 ]; then
        mkdir -p "$SUB" || exit 2
        echo "$TASKS" > "$SUB/commands.txt" && echo "$SCRIPT" > "$SUB/array.sbatch" || exit 2
        job=$(sbatch --parsable ${SBATCH_ARGS-} "$SUB/array.sbatch") || die "sbatch failed"
        echo "submitted array job $job: $n runs, from $SUB"; dep="--dependency=afterok:${job%%;*}"
    fi
    [ "${ANALYZE-1}" = 1 ] && sbatch ${SBATCH_ARGS-} --job-name="qkgeom-$PRESET-analyze" \
        --cpus-per-task=2 --mem=8G --time=1:00:00 $dep --output="$OUT/logs/analyze_%j.out" \
        --wrap="$(printf '%q ' "$PYTHON" "$REPO/analyze.py" "$OUT")"
    exit 0
fi
commands() {  # NUL-ended fields: each run's name, the length of its command, its command
    for i in ${TODO[@]+"${TODO[@]}"}; do
        command_of "$i"; printf '%s\0' "${NAMES[$i]}" "${#CMD[@]}" "${CMD[@]}"
    done
}
# sweep.py trains them, JOBS at once (a stop signal stops each after its checkpoint), then analyzes
exec "${SWEEP_PY[@]}" run "$OUT" "$JOBS" "$THREADS" "${ANALYZE-1}" "$PYTHON" \
    ${GPUS[@]+"${GPUS[@]}"} < <(commands)
