#!/usr/bin/env bash
# The whole study and the control experiment, then the analysis. Stop it at any time (Ctrl-C, SIGTERM,
# a lost session): running runs checkpoint, and the same command again trains only what is left.
#
#   bash sweep.sh                          # PRESET=paper: the study at train.py's GPU sizes, one run per GPU
#   PRESET=cpu JOBS=2 bash sweep.sh        # CPU sizes on WikiText-103's test split, 77 runs (time: the cpu preset)
#   PRESET=smoke bash sweep.sh             # every run for a few iterations: checks the plumbing in minutes
#   bash sweep.sh --max_iters=2000         # extra --key=value arguments (or config files) go to every run;
#                                          # not --run_name= or --out_dir=, which sweep.sh sets (OUT, the grid)
#   BACKEND=slurm bash sweep.sh            # a Slurm job array, then the analysis as a dependent job
#
# Environment (default in brackets; a grid variable set to "" leaves that part out):
#   PRESET      paper | cpu | ladder | smoke [paper]
#   OUT         where the run folders go [out/$PRESET]; per-run console output in $OUT/logs/NAME.log
#   DATA_FILE   a UTF-8 text to train on, its first 90% for training and the last 10% for validation ['':
#               the preset's dataset: the whole WikiText-103 for paper; for cpu, ladder and smoke its 1.3 MB
#               test split (--dataset=wikitext103-test: wiki.test.raw alone, downloaded once into train.py's
#               data_dir, split like DATA_FILE); an extra --dataset=... argument picks another]
#   JOBS        runs at once [local: the number of visible GPUs, else of CPU cores; slurm: 8]
#   DEPTHS [4 6 8]  INITS [normal orthogonal tied]  SEEDS [1 2 3 4]            the study
#   CONTROL_DEPTH [4]  CONTROL_SEEDS [1 2 3 4 5]  CONTROL_KEEPS [fro spec]            the control experiment
#   SHRINK_TOS [0.2 0.14 0.1]   the shrink doses (shrink_to), each with every keep
#   WIDTHS [32 64 128 256 384]  LADDER_SEEDS [1 2 3]  LONG_ITERS [8000]  LRS [3e-4 3e-3]
#   CONTROL_WIDTH [256]         the regime ladder (PRESET=ladder)
#   MIRROR      1: every control run also with control_target=q (the mirror), for both keeps [0]
#   RUN_LIST    a file of runs to do instead of the grid, one per line: NAME --key=value ... (as $OUT/runs.txt)
#   ANALYZE     1: run analyze.py on $OUT at the end; 0: do not [1]
#   BACKEND     local | slurm [local];  DRY_RUN=1 prints what would run or be submitted, and stops there
#   SBATCH_ARGS extra sbatch options for both jobs, e.g. "--partition=gpu --account=me" ['']
#   PYTHON      the interpreter [python, else python3]
for arg; do  # --help anywhere: this header, whatever else is set
    case $arg in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
done
PRESET=${PRESET:-paper}

# ----------------------------------------------------------------------------- presets
# --key=value overrides given to every run; SLURM: #SBATCH options of one array task
case $PRESET in
paper)  # train.py's defaults, sized for one GPU; nanoGPT quotes ~3 min on an A100 for its shakespeare_char
        # model of the same shape (6 layers, 384 wide, 5000 iterations). Not measured for this project: on a GPU
        # machine, `bash gpu_check.sh` times one run and the best JOBS per GPU, and estimates the whole study
    PRESET_ARGS=(--n_embd=384 --n_head=6 --block_size=256 --batch_size=64 --max_iters=5000
                 --eval_interval=250 --geom_interval=250 --eval_iters=20 --shrink_iters=2000)
    SLURM=(--gres=gpu:1 --cpus-per-task=4 --mem=16G --time=4:00:00)
    dataset='' ;;
cpu)    # 77 runs (36 study + 45 control, 4 shared). The 57 runs of results/cpu-wikitext103/ (one shrink dose)
        # took 61 min with JOBS=2 on 2 CPU cores busy with other work (its README has every stage's time)
    PRESET_ARGS=(--n_embd=64 --n_head=4 --block_size=64 --batch_size=16 --max_iters=2000
                 --eval_interval=200 --geom_interval=200 --eval_iters=10 --shrink_iters=400)
    SLURM=(--cpus-per-task=1 --mem=2G --time=1:00:00)
    dataset=wikitext103-test ;;
ladder) # the cpu preset's batch, context and schedule at widths 32 to 384 (the paper preset's model shape),
        # 4x longer, lr x1/3 and x3, and the freeze control at width 256: see the grid below
    PRESET_ARGS=(--n_layer=4 --qk_init=normal --block_size=64 --batch_size=16 --max_iters=2000
                 --eval_interval=200 --geom_interval=200 --eval_iters=10 --shrink_iters=400)
    SLURM=(--cpus-per-task=1 --mem=4G --time=4:00:00)
    dataset=wikitext103-test ;;
smoke)  # a few iterations of a tiny model per run: the whole grid in minutes, for the tests
    PRESET_ARGS=(--n_embd=16 --n_head=2 --block_size=16 --batch_size=4 --max_iters=6 --warmup_iters=2
                 --eval_interval=3 --geom_interval=3 --eval_iters=1 --eval_windows=2 --ckpt_interval=3
                 --model_ckpts=3 --shrink_iters=4)
    SLURM=(--cpus-per-task=1 --mem=1G --time=0:10:00)
    dataset=wikitext103-test ;;
*)  echo "sweep.sh: unknown PRESET=$PRESET; use paper, cpu, ladder or smoke" >&2; exit 2 ;;
esac

# ----------------------------------------------------------------------------- settings
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DATA_FILE=${DATA_FILE:-}
OUT=${OUT:-out/$PRESET}
BACKEND=${BACKEND:-local}
DRY_RUN=${DRY_RUN:-0}
ANALYZE=${ANALYZE:-1}
DEPTHS=${DEPTHS-4 6 8}
INITS=${INITS-normal orthogonal tied}
SEEDS=${SEEDS-1 2 3 4}
CONTROL_DEPTH=${CONTROL_DEPTH:-4}
CONTROL_SEEDS=${CONTROL_SEEDS-1 2 3 4 5}
CONTROL_KEEPS=${CONTROL_KEEPS-fro spec}
SHRINK_TOS=${SHRINK_TOS-0.2 0.14 0.1}
WIDTHS=${WIDTHS-32 64 128 256 384}
LADDER_SEEDS=${LADDER_SEEDS-1 2 3}
LONG_ITERS=${LONG_ITERS-8000}
LRS=${LRS-3e-4 3e-3}
CONTROL_WIDTH=${CONTROL_WIDTH-256}
MIRROR=${MIRROR:-0}
PYTHON=${PYTHON:-$(command -v python >/dev/null 2>&1 && echo python || echo python3)}
EXTRA=("$@")
DATA_ARGS=() data='the whole WikiText-103 (--dataset=wikitext103)'
[ -n "$dataset" ] && DATA_ARGS=(--dataset="$dataset") data="the WikiText-103 test split (--dataset=$dataset)"
[ -n "$DATA_FILE" ] && DATA_ARGS=(--data_file="$DATA_FILE") data=$DATA_FILE

die() { echo "sweep.sh: $*" >&2; exit 2; }
fmt_time() {  # seconds -> 42s, 3.5m, 1.8h
    local s=$1
    if [ "$s" -ge 5400 ]; then awk -v s="$s" 'BEGIN { printf "%.1fh", s / 3600 }'
    elif [ "$s" -ge 90 ]; then awk -v s="$s" 'BEGIN { printf "%.1fm", s / 60 }'
    else echo "${s}s"; fi
}
case $BACKEND in local|slurm) ;; *) die "unknown BACKEND=$BACKEND; use local or slurm" ;; esac
for flag in MIRROR ANALYZE DRY_RUN; do  # DRY_RUN=yes must not start the whole sweep
    case ${!flag} in 0|1) ;; *) die "$flag=${!flag} must be 0 or 1" ;; esac
done
case ${JOBS:-1} in *[!0-9]*|0) die "JOBS=$JOBS must be a whole number of runs at once, at least 1 (or unset)" ;; esac
check_file() {  # check_file VAR FIX: VAR names a readable file, or one line says what it names instead
    local path=${!1} what
    if [ -f "$path" ] && [ -r "$path" ]; then return; fi
    if [ -L "$path" ] && [ ! -e "$path" ]; then what="is a link to $(readlink "$path"), which does not exist"
    elif [ ! -e "$path" ]; then what='does not exist'
    elif [ -d "$path" ]; then what='is a folder'
    elif [ ! -f "$path" ]; then what='is not a regular file (a device, pipe or socket)'
    else what='cannot be read (permission denied)'; fi
    die "$1=$path $what; $2"
}
[ -z "$DATA_FILE" ] || check_file DATA_FILE "set it to a UTF-8 text file, or leave it empty for the preset's dataset"
[ -z "${RUN_LIST:-}" ] || check_file RUN_LIST 'set RUN_LIST to a file of runs, one per line: NAME --key=value ...'
per_run_key() {  # one line on an extra argument that sets a key sweep.sh sets for each run
    die "$1: sweep.sh sets out_dir (from OUT) and run_name (from each run's settings, or RUN_LIST) itself;" \
        "set OUT=... for another folder, and leave both out of the extra arguments and config files"
}
config_files=()
for arg in ${EXTRA[@]+"${EXTRA[@]}"}; do
    case $arg in --run_name=*|--out_dir=*) per_run_key "${arg%%=*}=" ;; --*) ;; *) config_files+=("$arg") ;; esac
done
if [ "${#config_files[@]}" -gt 0 ]; then  # a config file (nanoGPT's set out_dir) is read as train.py reads it
    key=$("$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1]); import train
cfg = train.get_config(["--run_name=-", "--out_dir=-", *sys.argv[2:]])
print(" ".join(k for k in ("out_dir", "run_name") if cfg[k] != "-"))' "$REPO" "${PRESET_ARGS[@]}" "${EXTRA[@]}") ||
        die "the extra arguments above are not usable (nothing was run)"
    [ -z "$key" ] || per_run_key "${key// / and } in ${config_files[*]}"
fi

# ----------------------------------------------------------------------------- the grid
# the one place the study's grid is written: analyze.py reads the planned runs from $OUT/runs.txt
GRID=()      # the per-run --key=value settings, in the order they are run (no spaces inside a value)
heads_of() {  # the ladder's head count: 4 heads (head size growing with width) until head size 64, the
    # paper preset's, is reached; wider models add heads of 64 (384: 6 heads of 64, the paper's shape)
    [ "$1" -le 256 ] && echo 4 || echo $(($1 / 64))
}
if [ -z "${RUN_LIST:-}" ] && [ "$PRESET" = ladder ]; then
    # the regime ladder, seed outermost and the slowest runs first within a seed; every run named by its point
    for seed in $LADDER_SEEDS; do
        for width in $(echo $WIDTHS | tr ' ' '\n' | sort -rn); do
            w="--n_embd=$width --n_head=$(heads_of "$width")"
            [ "$width" = "$CONTROL_WIDTH" ] && for keep in $CONTROL_KEEPS; do
                name=w${width}_freeze-k-${keep}_s$seed
                GRID+=("$w --control=freeze --control_keep=$keep --run_name=$name --seed=$seed")
            done
            GRID+=("$w --run_name=w${width}_s$seed --seed=$seed")
        done
        for iters in $LONG_ITERS; do
            GRID+=("--n_embd=128 --n_head=4 --max_iters=$iters --run_name=w128_it${iters}_s$seed --seed=$seed")
        done
        for lr in $LRS; do  # the whole schedule scales: min_lr stays lr / 10
            min_lr=$(awk -v x="$lr" 'BEGIN { printf "%g", x / 10 }')
            GRID+=("--n_embd=64 --n_head=4 --lr=$lr --min_lr=$min_lr --run_name=w64_lr${lr}_s$seed --seed=$seed")
        done
    done
    n_study=${#GRID[@]}
elif [ -z "${RUN_LIST:-}" ]; then
    # the study: depth x qk_init x seed; seed outermost, so a sweep stopped early has every setting
    for seed in $SEEDS; do for depth in $DEPTHS; do for init in $INITS; do
        GRID+=("--n_layer=$depth --qk_init=$init --seed=$seed")
    done; done; done
    n_study=${#GRID[@]}
    # the control experiment at one depth, qk_init normal: shrink and freeze keeping the Frobenius norm (fro,
    # train.py's default) or the top singular value (spec: the shape changes, the largest logit scale does not).
    # Its `none` runs have exactly the settings of the study's L4_normal_s* runs (same folder name): those
    # are shared, not trained twice
    targets=k
    [ "$MIRROR" = 1 ] && targets='k q'
    for seed in $CONTROL_SEEDS; do
        GRID+=("--n_layer=$CONTROL_DEPTH --qk_init=normal --seed=$seed")
        for target in $targets; do for keep in $CONTROL_KEEPS; do
            args="--n_layer=$CONTROL_DEPTH --qk_init=normal --control_target=$target --control_keep=$keep"
            for dose in $SHRINK_TOS; do GRID+=("$args --control=shrink --shrink_to=$dose --seed=$seed"); done
            GRID+=("$args --control=freeze --seed=$seed")
        done; done
    done
fi

NAMES=()     # run folder names, in the order they are run
RUN_ARGS=()  # the settings of each, as in GRID
add_run() {  # add_run NAME ARGS...: a run, unless one of that name is already listed (then it is shared)
    local name=$1 n
    shift
    for n in "${NAMES[@]}"; do [ "$n" = "$name" ] && { shared=$((shared + 1)); return; }; done
    NAMES+=("$name")
    RUN_ARGS+=("$*")
}
# the extra arguments can rename a run (--seed=, --control_keep=); one with a space in it cannot
NAME_EXTRA=()
for arg in ${EXTRA[@]+"${EXTRA[@]}"}; do case $arg in *[[:space:]]*) ;; *) NAME_EXTRA+=("$arg") ;; esac; done
name_grid() {  # one name per GRID line, from train.py (the one source of run names), which checks every line
    local args
    for args in "${GRID[@]}"; do echo "${PRESET_ARGS[*]} $args ${NAME_EXTRA[*]}"; done |
        "$PYTHON" "$REPO/train.py" --print_run_names
}
shared=0
if [ -n "${RUN_LIST:-}" ]; then
    while read -r name args; do
        case $name in ''|'#'*) continue ;; esac
        add_run "$name" $args
    done < "$RUN_LIST"
    what="from $RUN_LIST"
elif [ "${#GRID[@]}" -gt 0 ]; then
    grid_names=$(name_grid) || die "the grid's settings above are not usable (nothing was run)"
    i=0
    while read -r name; do
        add_run "$name" ${GRID[$i]}
        i=$((i + 1))
    done <<< "$grid_names"
    [ "$i" = "${#GRID[@]}" ] || die "train.py --print_run_names gave $i names for ${#GRID[@]} runs"
    what="$n_study study + $((${#GRID[@]} - n_study)) control, $shared in both"
    [ "$PRESET" = ladder ] && what="the regime ladder"
fi
N=${#NAMES[@]}
[ "$N" -gt 0 ] || die "the grid is empty (DEPTHS, INITS, SEEDS and CONTROL_SEEDS are all empty?)"

# ----------------------------------------------------------------------------- one sweep per OUT
# An flock on $LOCK, taken on this shell's fd 9: every worker and run started here inherits it, and the OS
# releases it when the last of them exits. So a sweep killed outright (SIGKILL, power cut) leaves no stale
# lock while none of its runs trains on, and of two sweeps starting at once exactly one gets it.
LOCK=$OUT/.sweep.pid   # two sweeps on one OUT would train the same runs; the file names the holder's pid
LOCK_PY='import errno, fcntl, os, sys
what, path = sys.argv[1:3]
try:  # take: the lock on fd 9, then the pid into the file; check: whether another process holds it
    fd = 9 if what == "take" else os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except FileNotFoundError:
    sys.exit(0)
except OSError as e:
    sys.exit(1 if e.errno in (errno.EAGAIN, errno.EACCES) else 4)
if what == "take":
    try:  # the holder removes the file as it ends: a lock on a removed file is no lock
        same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        same = False
    if not same:
        sys.exit(3)
    os.ftruncate(fd, 0)
    os.write(fd, f"{sys.argv[3]}\n".encode())'
refuse_locked() {  # one line naming the holder
    local holder
    holder=$(cat "$LOCK" 2>/dev/null)
    if [ -n "$holder" ] && ps -o args= -p "$holder" 2>/dev/null | grep -q sweep.sh; then
        die "another sweep (pid $holder) is running in $OUT; stop it first, or use another OUT"
    fi
    die "another sweep, or runs left by one that was killed, hold $LOCK; stop them first, or use another OUT"
}
lock_failed() {  # lock_failed STATUS: the status of LOCK_PY that is not 0
    [ "$1" = 1 ] && refuse_locked
    die "cannot lock $LOCK with $PYTHON (status $1; a file system without flock?); use an OUT on a local disk"
}
take_lock() {
    local rc
    mkdir -p "$OUT" || die "cannot create $OUT"
    for _ in 1 2 3; do
        { exec 9>>"$LOCK"; } 2>/dev/null || die "cannot write $LOCK"
        "$PYTHON" -c "$LOCK_PY" take "$LOCK" $$; rc=$?
        [ "$rc" = 3 ] || break
    done
    [ "$rc" = 0 ] || lock_failed "$rc"
}
check_lock() {  # before this sweep writes anything in $OUT
    [ -e "$LOCK" ] || return 0
    "$PYTHON" -c "$LOCK_PY" check "$LOCK" || lock_failed $?
}

# ----------------------------------------------------------------------------- what is left to do
# a dry run writes nothing here (a Slurm one only its scripts, below); a real one first makes sure it is alone
if [ "$DRY_RUN" != 1 ]; then
    if [ "$BACKEND" = local ]; then
        take_lock
        trap 'rm -rf ${STATE:+"$STATE"}; rm -f "$LOCK"' EXIT
    else
        check_lock  # submitting does not hold the lock: the array outlives this script
    fi
    mkdir -p "$OUT/logs" || die "cannot create $OUT/logs"
    [ -n "${RUN_LIST:-}" ] || for i in "${!NAMES[@]}"; do echo "${NAMES[$i]} ${RUN_ARGS[$i]}"; done > "$OUT/runs.txt"
fi
TODO=()      # indices into NAMES of the runs without done.json
for i in "${!NAMES[@]}"; do [ -f "$OUT/${NAMES[$i]}/done.json" ] || TODO+=("$i"); done
n_skip=$((N - ${#TODO[@]}))

# the command line of run i: preset, data, its own settings, the sweep's, then the extra arguments
train_cmd() {
    CMD=("$PYTHON" "$REPO/train.py" "${PRESET_ARGS[@]}" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} ${RUN_ARGS[$1]}
         --out_dir="$OUT" --run_name="${NAMES[$1]}" "$2" ${EXTRA[@]+"${EXTRA[@]}"})
}
# encode the data once, before any run (workers would each do it), and check the shared settings
prepare_data() {
    "$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1]); import prepare, train
prepare.prepare_data(train.get_config(sys.argv[2:]))' "$REPO" "${PRESET_ARGS[@]}" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
        --out_dir="$OUT" ${EXTRA[@]+"${EXTRA[@]}"} && return
    [ -n "${stopping:-}" ] && { echo "stopped by SIG$stopping before any run started"; exit 130; }
    [ -n "$DATA_FILE" ] && die "the data or the settings above are not usable (nothing was run)"
    die "the data or the settings above are not usable (nothing was run); without network, put the file named" \
        "above where it says, or set DATA_FILE=PATH to train on a local UTF-8 text"
}

# ----------------------------------------------------------------------------- back end: Slurm
if [ "$BACKEND" = slurm ]; then
    JOBS=${JOBS:-8}
    dir=$OUT/slurm/$(date +%Y%m%d-%H%M%S)
    mkdir -p "$dir" && dir=$(cd "$dir" && pwd) || die "cannot create $dir"
    for i in ${TODO[@]+"${TODO[@]}"}; do echo "${NAMES[$i]} ${RUN_ARGS[$i]}"; done > "$dir/runs.txt"
    # the interpreter itself (not a shim or an alias), so the jobs run in this environment
    PY=$("$PYTHON" -c 'import sys; print(sys.executable)') || die "cannot run PYTHON=$PYTHON"
    # the array task: line SLURM_ARRAY_TASK_ID of runs.txt, its output to the same log as a local run
    {
        echo '#!/usr/bin/env bash'
        echo "# qkgeom sweep, PRESET=$PRESET: one run of $dir/runs.txt per array task (written by sweep.sh)."
        echo '# Submit again with `BACKEND=slurm bash sweep.sh`: finished runs are skipped, stopped ones resume.'
        echo "#SBATCH --job-name=qkgeom-$PRESET"
        echo "#SBATCH --array=0-$((${#TODO[@]} - 1))%$JOBS"
        echo "#SBATCH --output=$dir/%A_%a.out"
        for opt in "${SLURM[@]}"; do echo "#SBATCH $opt"; done
        echo "cd $(printf %q "$PWD")"
        printf 'read -r name args < <(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" %q)\n' "$dir/runs.txt"
        printf 'log=%q/logs/$name.log\n' "$OUT"
        printf '[ -f %q/"$name"/done.json ] && { echo "$name is already done"; exit 0; }\n' "$OUT"
        echo 'echo "# $(date) slurm task ${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID on $(hostname)" >> "$log"'
        echo '# exec: at the time limit (or on scancel) Slurm sends SIGTERM to train.py, which checkpoints'
        printf 'exec %q %q' "$PY" "$REPO/train.py"
        printf ' %q' "${PRESET_ARGS[@]}" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"}
        printf ' $args --out_dir=%q --run_name="$name" --threads=${SLURM_CPUS_PER_TASK:-1}' "$OUT"
        [ "${#EXTRA[@]}" -gt 0 ] && printf ' %q' "${EXTRA[@]}"
        echo ' >> "$log" 2>&1'
    } > "$dir/array.sbatch"
    {
        echo '#!/usr/bin/env bash'
        echo "#SBATCH --job-name=qkgeom-$PRESET-analyze"
        echo "#SBATCH --output=$dir/analyze_%j.out"
        printf '#SBATCH %s\n' --cpus-per-task=2 --mem=8G --time=1:00:00 --kill-on-invalid-dep=yes
        echo 'set -o pipefail'
        echo "cd $(printf %q "$PWD")"
        printf '%q ' "$PY" "$REPO/analyze.py" "$OUT"
        printf '2>&1 | tee -a %q/logs/analyze.log\n' "$OUT"
    } > "$dir/analyze.sbatch"
    echo "sweep: PRESET=$PRESET, $N runs ($what): ${#TODO[@]} to submit, $n_skip already done; OUT=$OUT"
    array_cmd=() analyze_cmd=()
    [ "${#TODO[@]}" -gt 0 ] && array_cmd=(sbatch --parsable $SBATCH_ARGS "$dir/array.sbatch")
    if [ "$ANALYZE" = 1 ]; then
        analyze_cmd=(sbatch --parsable $SBATCH_ARGS "$dir/analyze.sbatch")
        [ "${#TODO[@]}" -gt 0 ] &&
            analyze_cmd=(sbatch --parsable $SBATCH_ARGS --dependency=afterok:JOBID "$dir/analyze.sbatch")
    fi
    if [ "$DRY_RUN" = 1 ]; then
        echo "DRY_RUN=1: written to $dir, not submitted"
        echo "---- $dir/array.sbatch"; cat "$dir/array.sbatch"
        echo "---- $dir/analyze.sbatch"; cat "$dir/analyze.sbatch"
        echo "---- would run (JOBID: the job id the first sbatch prints)"
        [ "${#array_cmd[@]}" -gt 0 ] && echo "${array_cmd[*]}"
        [ "${#analyze_cmd[@]}" -gt 0 ] && echo "${analyze_cmd[*]}"
        exit 0
    fi
    command -v sbatch >/dev/null 2>&1 || die "sbatch is not on PATH (BACKEND=slurm needs a Slurm login node)"
    # on the submitting host: compute nodes often have no network for the WikiText-103 download
    [ "${#TODO[@]}" -gt 0 ] && prepare_data
    jobid=
    if [ "${#array_cmd[@]}" -gt 0 ]; then
        jobid=$("${array_cmd[@]}") || die "sbatch failed: ${array_cmd[*]}"
        jobid=${jobid%%;*}
        echo "submitted job array $jobid: ${#TODO[@]} runs, at most $JOBS at once; logs in $OUT/logs/"
    fi
    if [ "${#analyze_cmd[@]}" -gt 0 ]; then
        analyze_cmd=("${analyze_cmd[@]/JOBID/$jobid}")
        ajob=$("${analyze_cmd[@]}") || die "sbatch failed: ${analyze_cmd[*]}"
        echo "submitted analysis job ${ajob%%;*}${jobid:+ (starts when every task of $jobid succeeded)}: $OUT/analysis/"
    fi
    exit 0
fi

# ----------------------------------------------------------------------------- back end: local workers
GPUS=()
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=', ' read -ra GPUS <<< "$CUDA_VISIBLE_DEVICES"
elif command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=($(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null))
fi
NCPU=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
JOBS=${JOBS:-${#GPUS[@]}}
[ "$JOBS" -gt 0 ] 2>/dev/null || JOBS=$NCPU
THREADS=$((NCPU / JOBS))
[ "$THREADS" -ge 1 ] || THREADS=1
where="CPU, --threads=$THREADS each"
[ "${#GPUS[@]}" -gt 0 ] && where="GPUs ${GPUS[*]} (round-robin), --threads=$THREADS each"

echo "sweep: PRESET=$PRESET, $N runs ($what): ${#TODO[@]} to train, $n_skip already done; OUT=$OUT"
echo "       JOBS=$JOBS on $where; data: $data; logs in $OUT/logs/"
if [ "$DRY_RUN" = 1 ]; then
    for i in "${!NAMES[@]}"; do
        train_cmd "$i" --threads="$THREADS"
        [ -f "$OUT/${NAMES[$i]}/done.json" ] && echo "skip (done) ${NAMES[$i]}" || echo "${CMD[*]}"
    done
    exit 0
fi

rm -rf "$OUT"/.sweep.??????  # under the lock, any other state folder is a dead sweep's
STATE=$(mktemp -d "$OUT/.sweep.XXXXXX") || die "cannot create a state folder in $OUT"
stopping=
trap 'stopping=INT; [ -n "${WORKERS:-}" ] && kill -TERM $WORKERS 2>/dev/null' INT
trap 'stopping=TERM; [ -n "${WORKERS:-}" ] && kill -TERM $WORKERS 2>/dev/null' TERM
trap 'stopping=HUP; [ -n "${WORKERS:-}" ] && kill -TERM $WORKERS 2>/dev/null' HUP  # the terminal went away
trap '' PIPE  # output piped to a reader that quit (| head): carry on, the logs have everything

k=0
for i in "${!NAMES[@]}"; do
    [ -f "$OUT/${NAMES[$i]}/done.json" ] && { k=$((k + 1)); echo "[$k/$N] ${NAMES[$i]}, skipped (done.json exists)"; }
done
if [ "${#TODO[@]}" -gt 0 ]; then
    prepare_data
fi
[ -n "$stopping" ] && { echo "stopped by SIG$stopping before any run started"; exit 130; }
T0=$(date +%s)

# one line per finished run, numbered in the order they finish; a mkdir is the lock (portable, atomic)
report() {  # report ok|failed|stopped NAME SECONDS [EXIT]
    local now n_done eta line tries=0
    until mkdir "$STATE/lock" 2>/dev/null; do  # after 10 s its holder must have died: go on
        tries=$((tries + 1)); [ "$tries" -lt 100 ] || break; sleep 0.1
    done
    echo "$1 $2 $3 ${4:-}" >> "$STATE/finished"
    if [ "$1" = stopped ]; then
        line="       $2, stopped after $(fmt_time "$3"): next time it starts over (no checkpoint yet)"
        [ -f "$OUT/$2/ckpt.pt" ] &&
            line="       $2, stopped after $(fmt_time "$3"): next time it resumes from its checkpoint"
    else
        n_done=$(grep -cv '^stopped' "$STATE/finished")
        now=$(date +%s)
        eta=$(( (now - T0) * (${#TODO[@]} - n_done) / n_done ))
        line="[$((n_skip + n_done))/$N] $2, $(fmt_time "$3"), ETA $(fmt_time "$eta")"
        [ "$1" = failed ] && line="[$((n_skip + n_done))/$N] $2, FAILED (exit $4) after $(fmt_time "$3"), see\
 $OUT/logs/$2.log, ETA $(fmt_time "$eta")"
    fi
    echo "$line"
    rmdir "$STATE/lock"
}

# worker w: takes the next unclaimed run (mkdir is the claim) until none is left or the sweep stops
worker() {
    local w=$1 j i name log t0 rc py= stop=
    trap 'stop=1; [ -n "$py" ] && kill -TERM "$py" 2>/dev/null' TERM INT HUP
    local env=()
    [ "${#GPUS[@]}" -gt 0 ] && env=(env CUDA_VISIBLE_DEVICES="${GPUS[$((w % ${#GPUS[@]}))]}")
    for j in "${!TODO[@]}"; do
        [ -n "$stop" ] && break
        mkdir "$STATE/claim.$j" 2>/dev/null || continue
        i=${TODO[$j]} name=${NAMES[$i]} log=$OUT/logs/${NAMES[$i]}.log
        train_cmd "$i" --threads="$THREADS"
        echo "# $(date) worker $w${env[1]:+ ${env[1]}}: ${CMD[*]}" >> "$log"
        t0=$(date +%s)
        ${env[@]+"${env[@]}"} "${CMD[@]}" >> "$log" 2>&1 < /dev/null &
        py=$!
        wait "$py"; rc=$?
        while kill -0 "$py" 2>/dev/null; do wait "$py"; rc=$?; done  # a signal cut the wait short
        py=
        # exit 129/130/143: stopped by SIGHUP/SIGINT/SIGTERM, also when sent to train.py alone
        case $rc in 129|130|143) stop=1 ;; esac
        if [ -f "$OUT/$name/done.json" ]; then report ok "$name" $(($(date +%s) - t0))
        elif [ -n "$stop" ]; then report stopped "$name" $(($(date +%s) - t0)) "$rc"
        else report failed "$name" $(($(date +%s) - t0)) "$rc"; fi
    done
}

WORKERS=
for ((w = 0; w < JOBS && w < ${#TODO[@]}; w++)); do
    worker "$w" &
    WORKERS="$WORKERS $!"
done
[ -n "$stopping" ] && kill -TERM $WORKERS 2>/dev/null  # a signal that came while they were starting
for pid in $WORKERS; do
    while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
done

# ----------------------------------------------------------------------------- summary and analysis
n_ok=$(grep -c '^ok' "$STATE/finished" 2>/dev/null)
FAILED=$(grep '^failed' "$STATE/finished" 2>/dev/null | cut -d' ' -f2)
if [ -z "$stopping" ] && grep -q '^stopped' "$STATE/finished" 2>/dev/null; then
    stopping=TERM  # runs stopped by a signal that did not reach this shell (sent to them, or ignored here)
    grep -q '^stopped .* 130$' "$STATE/finished" && stopping=INT
fi
if [ -n "$stopping" ]; then
    echo "stopped by SIG$stopping: $((n_skip + ${n_ok:-0})) of $N runs done;" \
         "run the same command again to finish the rest"
    case $stopping in HUP) exit 129 ;; INT) exit 130 ;; *) exit 143 ;; esac
fi
status=0
if [ "$ANALYZE" = 1 ]; then
    echo "analysis: $PYTHON $REPO/analyze.py $OUT (log: $OUT/logs/analyze.log)"
    "$PYTHON" "$REPO/analyze.py" "$OUT" 2>&1 | tee "$OUT/logs/analyze.log"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "the analysis FAILED, see $OUT/logs/analyze.log"; status=1; }
fi
echo "sweep finished in $(fmt_time $(($(date +%s) - T0))): $N runs, $n_skip skipped (done before), ${n_ok:-0} trained" \
     "now, $(echo $FAILED | wc -w) failed"
if [ -n "$FAILED" ]; then
    for name in $FAILED; do
        echo "  FAILED $name: see $OUT/logs/$name.log, which ends:"
        tail -n 3 "$OUT/logs/$name.log" | sed 's/^/      /'
    done
    echo "fix the cause and run the same command again: finished runs are skipped, the rest resume or restart"
    exit 1
fi
exit $status
