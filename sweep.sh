#!/usr/bin/env bash
# A study's grid of train.py runs, then the analysis (README.md, Sweeps). Stop it at any time: the same command trains
# what is left. Arguments (--key=value, config files) go to every run and into its name.
#
# Environment [default], each checked before anything runs:
#   PRESET     paper | cpu | wide | ladder | length | optim | smoke [paper]   OUT  where the runs go [out/$PRESET]
#   JOBS       runs at once [the number of visible GPUs, else of CPU cores]   ARRAY_JOBS  the same under Slurm [16]
#   DATA_FILE  a UTF-8 text to train every run on [the preset's dataset]      DRY_RUN  1 | 0 [0]
#   RUN_LIST   a file of runs instead of the grid, one per line: NAME --key=value ... (Windows line ends too)
#   ANALYZE    1 | 0: python analyze.py OUT at the end [1]      BACKEND  local | slurm [local]
#   PYTHON     the interpreter [python3]                        SBATCH_ARGS  extra sbatch options ['']
#   the grid: the variables in the loops below, with their defaults (set one to "" to leave that part out)
for arg; do case $arg in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}; /^# -* the grid/,/^case/p' "$0"; exit 0 ;; esac; done
set -u
die() { echo "sweep.sh: $*" >&2; exit 2; }
for v in OUT DATA_FILE RUN_LIST PYTHON; do [ -n "${!v-unset}" ] || die "$v=\"\": unset it for its default"; done
PRESET=${PRESET-paper} OUT=${OUT-out/${PRESET-paper}} BACKEND=${BACKEND-local} PYTHON=${PYTHON-python3}
case $BACKEND in local|slurm) ;; *) die "BACKEND=$BACKEND: use local or slurm" ;; esac
for v in DRY_RUN ANALYZE PRINT_ARGS; do [[ ${!v-0} =~ ^[01]$ ]] || die "$v=${!v}: use 1 (yes) or 0 (no)"; done
for v in JOBS ARRAY_JOBS; do [[ ${!v-1} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: runs at once, a number >= 1"; done
for v in WIDTHS CONTROL_WIDTH; do [[ ${!v-} =~ ^[[:space:][:digit:]]*$ ]] || die "$v=${!v}: whole numbers"; done
GRID_NUMBERS=(DEPTHS SEEDS CONTROL_SEEDS LADDER_SEEDS LONG_ITERS LENGTHS DROPOUT_LENGTHS LENGTH_SEEDS SCAN_SEEDS
              ARM_SEEDS SHRINK_TOS LRS ADAMW_LRS SGD_LRS OPTIM_SHRINK ADAMW_LR SGD_LR)  # train.py checks type and range
for v in "${GRID_NUMBERS[@]}"; do
    [[ ${!v-} =~ ^([[:space:][:digit:].]|[eE][-+]?)*$ ]] || die "$v=${!v}: numbers >= 0, separated by spaces"
done
[ -z "${DATA_FILE-}" ] || [ -f "$DATA_FILE" ] || die "DATA_FILE=$DATA_FILE is not a file"
[[ $BACKEND = slurm && $OUT == *[#%]* ]] && die "OUT=$OUT: Slurm reads # in #SBATCH lines as a comment, % as a pattern"
REPO=$(cd "$(dirname "$0")" && pwd)
CPU_SIZE=(--n_embd=64 --n_head=4 --block_size=64 --batch_size=16 --max_iters=2000 --eval_interval=200
          --geom_interval=200 --eval_iters=10 --shrink_iters=400 --dataset=wikitext103-test)
# ----------------------------------------------------------------------------- presets
SLURM=(--cpus-per-task=1 --mem=4G --time=4:00:00)  # what a Slurm task asks for, unless the preset says otherwise
case $PRESET in
paper)  ARGS=(--n_embd=384 --n_head=6 --block_size=256 --batch_size=64 --max_iters=5000 --eval_interval=250
              --geom_interval=250 --eval_iters=20 --shrink_iters=2000)
        SLURM=(--gres=gpu:1 --cpus-per-task=4 --mem=16G --time=4:00:00) ;;
cpu)    ARGS=("${CPU_SIZE[@]}") SLURM=(--cpus-per-task=1 --mem=2G --time=1:00:00) ;;
ladder) ARGS=("${CPU_SIZE[@]}" --n_layer=4 --qk_init=normal) ;;
length) ARGS=("${CPU_SIZE[@]}" --n_layer=4 --n_embd=128 --qk_init=tied --decay_qk=False) SLURM[2]=--time=8:00:00 ;;
wide)   ARGS=("${CPU_SIZE[@]}" --n_embd=128 --max_iters=4000 --shrink_iters=800) ;;
optim)  ARGS=("${CPU_SIZE[@]}" --n_layer=4) SLURM=(--cpus-per-task=1 --mem=2G --time=1:00:00) ;;
smoke)  ARGS=(--n_embd=16 --n_head=2 --block_size=16 --batch_size=4 --max_iters=6 --warmup_iters=2 --eval_interval=3
              --geom_interval=3 --eval_iters=1 --eval_windows=2 --ckpt_interval=3 --model_ckpts=3 --shrink_iters=4
              --dataset=wikitext103-test) SLURM=(--cpus-per-task=1 --mem=1G --time=0:10:00) ;;
*)      die "unknown PRESET=$PRESET; use paper, cpu, wide, ladder, length, optim or smoke" ;;
esac
[ "${PRINT_ARGS-0}" = 1 ] && { echo "${ARGS[*]}"; exit 0; }  # the preset's sizes, for bench.py
[ -n "${DATA_FILE-}" ] && ARGS+=(--data_file="$DATA_FILE")
EXTRA=("$@")
case " $* " in *" --run_name="*|*" --out_dir="*) die "--run_name, --out_dir: sweep.sh names each run and puts it under OUT" ;; esac
# ----------------------------------------------------------------------------- the grid
GRID=()  # one line of --key=value settings per run; its name comes from train.py, so every setting is in it
add() { GRID+=("$*"); }
tenth() { awk -v lr="$1" 'BEGIN {print lr / 10}'; }  # min_lr; a value that is no number goes on to train.py's check
study() {  # depth x qk_init x seed, then the control experiment at depth 4 (its none runs are the study's)
    for seed in ${SEEDS-1 2 3 4}; do for depth in ${DEPTHS-4 6 8}; do for init in ${INITS-normal orthogonal tied}; do
        add --n_layer="$depth" --qk_init="$init" --seed="$seed"
    done; done; done
    controls "--n_layer=4 --qk_init=normal" "${CONTROL_SEEDS-1 2 3 4 5}" "${SHRINK_TOS-0.2 0.14 0.1}"
}
controls() {  # controls ARGS SEEDS DOSES: none, shrink at each dose and freeze, with each keep, per seed
    for seed in $2; do
        add $1 --seed="$seed"
        for keep in ${CONTROL_KEEPS-fro spec}; do
            for dose in $3; do add $1 --control=shrink --shrink_to="$dose" --control_keep="$keep" --seed="$seed"; done
            add $1 --control=freeze --control_keep="$keep" --seed="$seed"
        done
    done
}
ladder() {  # width (4 heads up to head size 64, then heads of 64), length, lr, and freeze at one width
    for seed in ${LADDER_SEEDS-1 2 3}; do
        for width in ${WIDTHS-32 64 128 256 384}; do
            heads=$(( width <= 256 ? 4 : width / 64 ))
            add --n_embd="$width" --n_head="$heads" --seed="$seed"
            [ "$width" = "${CONTROL_WIDTH-256}" ] && controls "--n_embd=$width --n_head=$heads" "$seed" ""  # freeze
        done
        for iters in ${LONG_ITERS-8000}; do add --n_embd=128 --max_iters="$iters" --seed="$seed"; done
        for lr in ${LRS-3e-4 3e-3}; do add --lr="$lr" --min_lr="$(tenth "$lr")" --seed="$seed"; done
    done
}
length() {  # how far training goes (the cosine schedule spans each length), and the same with dropout
    for seed in ${LENGTH_SEEDS-1 2 3}; do
        for iters in ${LENGTHS-2000 4000 8000 16000}; do add --max_iters="$iters" --seed="$seed"; done
        for iters in ${DROPOUT_LENGTHS-8000 16000}; do add --max_iters="$iters" --dropout=0.1 --seed="$seed"; done
    done
}
optim() {  # the lr scan of each optimizer, the arms at the tuned lrs, the key control at AdamW's
    local sgd="--optimizer=sgd --weight_decay=0"  # SGD's coupled decay at these lrs takes W_Q, W_K to zero
    for seed in ${SCAN_SEEDS-1 2}; do
        for lr in ${ADAMW_LRS-1e-3 3e-3 1e-2 3e-2}; do add --lr="$lr" --min_lr="$(tenth "$lr")" --seed="$seed"; done
        for lr in ${SGD_LRS-0.1 0.3 1 3}; do add $sgd --lr="$lr" --min_lr="$(tenth "$lr")" --seed="$seed"; done
    done
    local a="--lr=${ADAMW_LR-1e-2} --min_lr=$(tenth "${ADAMW_LR-1e-2}")"
    local s="$sgd --lr=${SGD_LR-0.3} --min_lr=$(tenth "${SGD_LR-0.3}")"
    for seed in ${ARM_SEEDS-1 2 3 4 5}; do
        for arm in "$a" "$a --decay_qk=False" "$a --qk_init=tied" "$s" "$s --qk_init=tied"; do add $arm --seed="$seed"; done
    done
    controls "$a" "${ARM_SEEDS-1 2 3 4 5}" "${OPTIM_SHRINK-0.1}"
}
wide() {  # the control (its none arm is depth 4, normal init) first, then the study depth by depth
    controls "--n_layer=4 --qk_init=normal" "${CONTROL_SEEDS-1 2 3 4 5}" "${SHRINK_TOS-0.2 0.1}"
    for depth in ${DEPTHS-4 6 8}; do for init in ${INITS-normal orthogonal tied}; do for seed in ${SEEDS-1 2 3 4}; do
        add --n_layer="$depth" --qk_init="$init" --seed="$seed"
    done; done; done
}
case $PRESET in ladder) ladder ;; length) length ;; optim) optim ;; wide) wide ;; *) study ;; esac
NAMES=() RUNS=()  # the runs to do, each once: a grid line whose name is already listed is shared
if [ -n "${RUN_LIST-}" ]; then
    [ "${#EXTRA[@]}" = 0 ] || die "extra arguments with RUN_LIST: put them into its lines"
    [ -f "$RUN_LIST" ] || die "RUN_LIST=$RUN_LIST is not a file"
    GRID=() n=0 seen=' '
    while read -r name args || [ -n "$name" ]; do  # a last line without a newline counts too
        n=$((n + 1)) name=${name%$'\r'} args=${args%$'\r'}  # and a Windows line end is a line end
        case $name in ''|'#'*) continue ;; --*|*/*|*..*|.) die "RUN_LIST line $n: '$name' is not a run name (NAME --key=value ...)" ;; esac
        case $seen in *" $name "*) die "RUN_LIST line $n: $name is listed twice" ;; esac
        seen="$seen$name " GRID+=("$args --run_name=$name")
    done < "$RUN_LIST"
fi
[ "${#GRID[@]}" -gt 0 ] || die "the grid is empty"
# train.py checks and names every line's run (each once) before anything runs; a finished run must have its settings
names=$(for line in "${GRID[@]}"; do printf '%q ' "${ARGS[@]}" $line ${EXTRA[@]+"${EXTRA[@]}"}; echo; done |
        "$PYTHON" -c 'import json, os, shlex, sys
sys.path.insert(0, sys.argv[1])
try:
    import train
    from plumbing import configurator
except ModuleNotFoundError as e:
    sys.exit(f"sweep.sh: {sys.executable} has no {e.name}: activate its venv or set PYTHON=/path/to/venv/bin/python")
keys = lambda args: {a[2:].partition("=")[0] for a in args if a.startswith("--")}
first = {}
for i, args in enumerate(map(shlex.split, sys.stdin)):
    cfg, cut = train.get_config(args), int(sys.argv[3]) if sys.argv[5] else len(args) - int(sys.argv[4])
    ours = (keys(args[:cut]) | {"run_name"}) - keys(args[cut:])  # after cut: a RUN_LIST line, or the extra arguments
    for path in [a for a in args[cut:] if not a.startswith("--")]:  # a config file: the sweep must not override it
        lost = " ".join(f"--{k}={v}" for k, v in configurator.file_settings(path).items()
                        if k in ours and (cfg[k] != v or k == "run_name"))
        if lost:
            sys.exit(f"sweep.sh: {path}: the preset or grid overrides it (a --key=value wins over a file): pass {lost}")
    if cfg["overwrite"]:  # a sweep skips finished runs and resumes stopped ones
        sys.exit("sweep.sh: overwrite=True: move a finished run away to train it again (nothing ran)")
    run = os.path.join(sys.argv[2], cfg["run_name"])
    old = json.load(open(run + "/config.json")) if os.path.exists(run + "/done.json") else cfg
    # every setting but where and how fast (NOT_IN_NAME); config.json holds the dtype that auto chose
    diff = "; ".join(f"{k} {old.get(k)} there, {v} here" for k, v in cfg.items() if old.get(k) != v
                     and k not in configurator.NOT_IN_NAME and (k, v) != ("dtype", "auto"))
    if diff:
        sys.exit(f"sweep.sh: {run} is finished with other settings ({diff}): move it away or rename the run")
    first.setdefault(cfg["run_name"], i)
print("\n".join(f"{i} {name}" for name, i in first.items()))' "$REPO" "$OUT" "${#ARGS[@]}" "${#EXTRA[@]}" "${RUN_LIST-}") || exit 2
while read -r i name; do NAMES+=("$name") RUNS+=("${GRID[$i]}"); done <<< "$names"
command_of() { CMD=("$PYTHON" "$REPO/train.py" "${ARGS[@]}" ${RUNS[$1]} ${EXTRA[@]+"${EXTRA[@]}"} --out_dir="$OUT"
                    --run_name="${NAMES[$1]}"); }  # the train.py command of run $1
shown() { command_of "$1"; printf '%q ' "${CMD[@]}"; echo "--threads=$THREADS${2-}"; }  # as a shell line
# ----------------------------------------------------------------------------- run them
if [ -n "${CUDA_VISIBLE_DEVICES-}" ]; then IFS=', ' read -ra GPUS <<< "$CUDA_VISIBLE_DEVICES"
else GPUS=($(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)); fi
NCPU=$(nproc 2>/dev/null || echo 1) JOBS=${JOBS-${#GPUS[@]}}
[ "$JOBS" -gt 0 ] || JOBS=$NCPU
THREADS=$(( NCPU / JOBS > 0 ? NCPU / JOBS : 1 )) TODO=()  # the runs not done yet
for i in "${!NAMES[@]}"; do [ -f "$OUT/${NAMES[$i]}/done.json" ] && echo "skip ${NAMES[$i]} (done)" || TODO+=("$i"); done
if [ "$BACKEND" = slurm ]; then  # one array task per run not done, read from this submission's own files
    JOBS=${ARRAY_JOBS-16} THREADS='${SLURM_CPUS_PER_TASK:-1}' SUB=$OUT/slurm/$(date +%Y%m%d-%H%M%S)-$$ dep=
    TASKS=$(for i in ${TODO[@]+"${TODO[@]}"}; do  # a task whose run another submission has finished does nothing
        printf '[ -f %q ] || ' "$OUT/${NAMES[$i]}/done.json"; shown "$i" " >> $(printf %q "$OUT/logs/${NAMES[$i]}.log") 2>&1"
    done) && n=${#TODO[@]}
    SBATCH=(--job-name="qkgeom-$PRESET" --array="0-$((n - 1))%$JOBS" --output="$SUB/%A_%a.out" "${SLURM[@]}")
    SCRIPT=$(echo '#!/usr/bin/env bash'
             printf '#SBATCH %q\n' "${SBATCH[@]}"
             printf 'eval "$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" %q)"\n' "$SUB/commands.txt")
fi
echo "sweep: PRESET=$PRESET, ${#NAMES[@]} runs in $OUT (${#TODO[@]} to train), JOBS=$JOBS, --threads=$THREADS each"
if [ "${DRY_RUN-0}" = 1 ]; then  # what would run, and nothing written
    [ "$BACKEND" = slurm ] && printf '%s\n' "# $SUB/array.sbatch:" "$SCRIPT" "# $SUB/commands.txt:" "$TASKS" && exit 0
    for i in ${TODO[@]+"${TODO[@]}"}; do shown "$i"; done; exit 0
fi
mkdir -p "$OUT/logs" && rm -f "$OUT"/logs/*.failed
"$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1]); import train; from plumbing import prepare
prepare.prepare_data(train.get_config(sys.argv[2:]))' "$REPO" "${ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"} ||
    die "cannot prepare the data (nothing ran)"
if [ "$BACKEND" = slurm ]; then  # the analysis after all of the array's tasks
    if [ "$n" -gt 0 ]; then
        mkdir -p "$SUB" && echo "$TASKS" > "$SUB/commands.txt" && echo "$SCRIPT" > "$SUB/array.sbatch" || exit 2
        job=$(sbatch --parsable ${SBATCH_ARGS-} "$SUB/array.sbatch") || die "sbatch failed"
        echo "submitted array job $job: $n runs, from $SUB"; dep="--dependency=afterok:${job%%;*}"
    fi
    ANALYSIS=(--job-name="qkgeom-$PRESET-analyze" --cpus-per-task=2 --mem=8G --time=1:00:00 $dep
              --output="$OUT/logs/analyze_%j.out" --wrap="$(printf '%q ' "$PYTHON" "$REPO/analyze.py" "$OUT")")
    [ "${ANALYZE-1}" = 1 ] && sbatch ${SBATCH_ARGS-} "${ANALYSIS[@]}"
    exit 0
fi
run_one() {  # run_one I SLOT: train run I, on GPU SLOT mod the number of GPUs when there are any
    command_of "$1"
    local name=${NAMES[$1]} log=$OUT/logs/${NAMES[$1]} t0=$SECONDS env=() rc=0 left
    [ "${#GPUS[@]}" -gt 0 ] && env=(env CUDA_VISIBLE_DEVICES="${GPUS[$(($2 % ${#GPUS[@]}))]}")
    echo "# $(date): ${CMD[*]}" >> "$log.log"
    ${env[@]+"${env[@]}"} "${CMD[@]}" --threads="$THREADS" >> "$log.log" 2>&1 < /dev/null || rc=1
    left=$(echo $((SECONDS - t0)) >> "$WALLS" && awk -v n="${#TODO[@]}" -v j="$JOBS" '{s += $1} END {t = s / NR * (n - NR) / j
        printf "%d of %d ended, about %.0f %s left", NR, n, t < 99 ? t : t / 60, t < 99 ? "s" : "min"}' "$WALLS")
    [ $rc = 0 ] && { echo "done $name in $((SECONDS - t0)) s ($left)"; return; }
    echo "FAILED $name after $((SECONDS - t0)) s ($left): $(tail -n 1 "$log.log")"; touch "$log.failed"
}
stop() {  # each run's own process group (not the caller's) checkpoints and stops; a second signal leaves at once
    trap 'exit 130' INT TERM HUP; set +m; local groups=$(jobs -p | sed 's/^/-/')
    kill -TERM -- $groups 2> /dev/null; while kill -0 -- $groups 2> /dev/null; do sleep 1; done
    echo "sweep.sh: stopped; the same command resumes the runs in $OUT" >&2; exit 130
}
WALLS=$(mktemp) && trap 'rm -f "$WALLS"' EXIT && trap stop INT TERM HUP  # WALLS: each ended run's seconds
set -m  # each run in a process group of its own, which stop signals
for k in ${TODO[@]+"${!TODO[@]}"}; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    run_one "${TODO[$k]}" "$k" &
done
wait; set +m
failed=$(ls "$OUT"/logs/*.failed 2>/dev/null | wc -l)
[ "$failed" = 0 ] || { echo "$failed runs failed (logs in $OUT/logs/); fix the cause and run the same command again"; exit 1; }
[ "${ANALYZE-1}" != 1 ] || "$PYTHON" "$REPO/analyze.py" "$OUT"
