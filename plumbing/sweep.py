"""sweep.sh's Python: it checks and names every run of a sweep before anything runs, prepares the
data once, and trains the runs on this machine. sweep.sh runs it as a script, one step a call:

    python plumbing/sweep.py check-env
    python plumbing/sweep.py run-list RUN_LIST N_EXTRA
    python plumbing/sweep.py names OUT N_PRESET N_EXTRA RUN_LIST < runs
    python plumbing/sweep.py prepare --key=value ...
    python plumbing/sweep.py run OUT JOBS THREADS ANALYZE PYTHON [GPU ...] < commands

names reads one run a line, its train.py arguments shell-quoted: the preset's N_PRESET, the grid
line's, then sweep.sh's N_EXTRA extra arguments. RUN_LIST is the path of the file of grid lines,
or '' for none. names prints 'INDEX NAME' for the first line of each run. run reads NUL-ended
fields: each run's name, the length of its command, its command. A stop is one line on stderr,
sweep.sh's (or train.py's about a setting), and exit status 1, on which sweep.sh exits 2.
"""
import contextlib
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

PLUMBING = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(PLUMBING)  # the repository root
SWEEP_SH = os.path.join(REPO, 'sweep.sh')

if __name__ == '__main__':
    # As a script, Python puts plumbing/ first on sys.path. The root goes there instead,
    # so that imports work as in train.py from any directory, and no plumbing module is top-level.
    if sys.path and os.path.realpath(sys.path[0]) == PLUMBING:
        sys.path[0] = REPO
    else:
        sys.path.insert(0, REPO)

train = configurator = None  # load() imports them, and torch with them, for names and prepare


def load():
    """Import train.py and the configurator (and torch), or stop naming the module Python lacks."""
    global train, configurator
    try:
        import train
        from plumbing import configurator
    except ModuleNotFoundError as e:  # most often torch: a Python outside the project's venv
        sys.exit(f'sweep.sh: {sys.executable} has no {e.name}: '
                 f'activate its venv or set PYTHON=/path/to/venv/bin/python')


# ----------------------------------------------------------------------------- variables


def variables(text):
    """The environment variables that a sweep.sh text reads: each ${NAME-default}."""
    return set(re.findall(r'\$\{([A-Z][A-Z0-9_]*):?-', text))


def one_edit_apart(a, b):
    """Whether b is a with one letter changed, added or dropped, or two neighbours swapped."""
    if len(a) > len(b):
        a, b = b, a
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if len(a) < len(b):
        return a[i:] == b[i + 1:]
    swapped = a[i:i + 2] == b[i:i + 2][::-1] and a[i + 2:] == b[i + 2:]
    return a[i + 1:] == b[i + 1:] or swapped


def meant(name, known):
    """The variable of known that name probably misspells, or None: the same letters but for case
    and underscores, one more or one less S, or (for names of 5 letters or more) one letter off.
    Other names (HOME, PATH, SLURM_JOB_ID, ...) are far from every one of them."""
    if name in known:
        return None
    upper = name.upper()
    for k in sorted(known):
        squeezed = upper.replace('_', '') == k.replace('_', '')
        plural = upper + 'S' == k or upper == k + 'S'
        if squeezed or plural or (len(k) >= 5 and one_edit_apart(upper, k)):
            return k
    return None


def check_env(environ):
    """Stop at a variable of environ that is a near miss of one sweep.sh reads: sweep.sh would
    ignore it and run its default."""
    with open(SWEEP_SH) as f:
        known = variables(f.read())
    for name in sorted(environ):
        k = meant(name, known)
        if k:
            sys.exit(f'sweep.sh: {name}={environ[name]}: sweep.sh reads no {name}; '
                     f'did you mean {k}? (nothing ran; unset {name} if not)')


def grid_variables(text):
    """{key: the variables whose loops set --key in a sweep.sh text}: a loop over ${VAR-...} in a
    function that sets --key from the loop's variable, or a loop over the function's argument $N
    where a call passes "${VAR-...}"."""
    text = text.replace('\\\n', ' ')
    found = {}
    for func, body in re.findall(r'^(\w+)\(\) \{[^\n{}]*\n(.*?)^\}', text, re.M | re.S):
        for loop, source in re.findall(r'for (\w+) in (\$\{\w+-[^}]*\}|\$\d)', body):
            names = re.findall(r'^\$\{(\w+)-', source) or passed(text, func, int(source[1:]))
            for key in re.findall(rf'--(\w+)="?\${loop}\b', body):
                for name in names:
                    if name not in found.setdefault(key, []):
                        found[key].append(name)
    return found


def passed(text, func, n):
    """The variables that calls of func in text pass as its argument n, as "${VAR-...}"."""
    names = []
    for call in re.findall(rf'^\s*{func} (.*)$', text, re.M):
        args = shlex.split(call, comments=True)
        if len(args) >= n and re.match(r'\$\{\w+-', args[n - 1]):
            names.append(re.match(r'\$\{(\w+)-', args[n - 1])[1])
    return names


# ----------------------------------------------------------------------------- names


def run_list(path, n_extra):
    """The grid lines of a RUN_LIST file, '--key=value ... --run_name=NAME' for each line
    'NAME --key=value ...' (blank lines and # comments aside, Windows line ends too), as bytes;
    stop at extra arguments, a name that is none (a path, or an option) or a name listed twice."""
    if n_extra:
        sys.exit('sweep.sh: extra arguments with RUN_LIST: put them into its lines')
    if not os.path.isfile(path):
        sys.exit(f'sweep.sh: RUN_LIST={path} is not a file')
    with open(path, 'rb') as f:
        text = f.read().replace(b'\0', b'')  # as bash's read: a NUL byte is dropped
    lines, seen = [], set()
    for n, line in enumerate(text.split(b'\n'), 1):
        # the name up to the first space or tab, the rest without those around it, as bash's read
        name, args = re.fullmatch(rb'[ \t]*([^ \t]*)[ \t]*(.*?)[ \t]*', line, re.S).groups()
        name, args = name.removesuffix(b'\r'), args.removesuffix(b'\r')
        shown = name.decode(errors='replace')
        if not name or name.startswith(b'#'):
            continue
        if name.startswith(b'--') or b'/' in name or b'..' in name or name == b'.':
            sys.exit(f"sweep.sh: RUN_LIST line {n}: '{shown}' is not a run name "
                     f'(NAME --key=value ...)')
        if name in seen:
            sys.exit(f'sweep.sh: RUN_LIST line {n}: {shown} is listed twice')
        seen.add(name)
        lines.append(args + b' --run_name=' + name)
    return lines


def keys(args):
    """The keys that the --key=value arguments among args set."""
    return {a[2:].partition('=')[0] for a in args if a.startswith('--')}


def user_start(args, n_preset, n_extra, listed):
    """Where the user's arguments start in a run's args: a RUN_LIST line (listed: its path, or '')
    follows the preset's arguments; else the user's are sweep.sh's extra arguments, at the end."""
    return n_preset if listed else len(args) - n_extra


def check_config_files(args, start, cfg):
    """Stop if a config file among the user's arguments sets what the preset or the grid sets: their
    --key=value wins over the file, whose value would be lost without a word."""
    ours = (keys(args[:start]) | {'run_name'}) - keys(args[start:])  # sweep.sh sets --run_name
    for path in [a for a in args[start:] if not a.startswith('--')]:
        lost = ' '.join(f'--{k}={v}' for k, v in configurator.file_settings(path).items()
                        if k in ours and (cfg[k] != v or k == 'run_name'))
        if lost:
            sys.exit(f'sweep.sh: {path}: the preset or grid overrides it '
                     f'(a --key=value wins over a file): pass {lost}')


def check_grid_keys(rows, n_preset, n_extra):
    """Stop at an extra --key=value that a grid line sets too: it would win over the grid's value
    in every run, and runs that differ only there would merge into one."""
    grid = set()
    for args in rows:
        grid |= keys(args[n_preset:len(args) - n_extra])
    for arg in rows[0][len(rows[0]) - n_extra:] if n_extra and rows else []:
        key, _, value = arg[2:].partition('=')
        if arg.startswith('--') and key in grid:
            with open(SWEEP_SH) as f:
                names = grid_variables(f.read()).get(key)
            instead = (f"{names[0]}={value} (the grid's variables for it: {', '.join(names)})"
                       if names else "the grid's variable for it (sweep.sh --help)")
            sys.exit(f'sweep.sh: {arg}: the grid sets --{key} run by run, '
                     f'and its runs would merge; set {instead} instead')


def check_finished(cfg, out):
    """Stop if the run is finished under out with other settings than cfg's: the sweep would skip
    it, and keep a run that is not the one asked for."""
    run = os.path.join(out, cfg['run_name'])
    if not os.path.exists(os.path.join(run, 'done.json')):
        return
    with open(os.path.join(run, 'config.json')) as f:
        old = json.load(f)
    # every setting but NOT_IN_NAME's; config.json holds the dtype that auto chose, not auto
    diff = '; '.join(f'{k} {old.get(k)} there, {v} here' for k, v in cfg.items()
                     if old.get(k) != v and k not in configurator.NOT_IN_NAME
                     and (k, v) != ('dtype', 'auto'))
    if diff:
        sys.exit(f'sweep.sh: {run} is finished with other settings ({diff}): '
                 f'move it away or rename the run')


def names(lines, out, n_preset, n_extra, listed):
    """{run name: the index of its first line} of the runs of lines, each checked by train.py; a
    later line with a name listed before is the same run, trained once."""
    rows = [shlex.split(line) for line in lines]
    check_grid_keys(rows, n_preset, n_extra)
    load()
    first = {}
    for i, args in enumerate(rows):
        cfg = train.get_config(args)
        check_config_files(args, user_start(args, n_preset, n_extra, listed), cfg)
        if cfg['overwrite']:  # a sweep skips finished runs and resumes stopped ones
            sys.exit('sweep.sh: overwrite=True: move a finished run away to train it again '
                     '(nothing ran)')
        check_finished(cfg, out)
        first.setdefault(cfg['run_name'], i)
    return first


def prepare_data(args):
    """Encode the text of a run with these arguments into the data cache, if it is not there: once,
    before any run, so that a text that cannot be read stops the sweep before anything runs."""
    load()
    from plumbing import prepare  # already imported by train.py
    prepare.prepare_data(train.get_config(args))


# ----------------------------------------------------------------------------- run

STOP = []  # the stop signal, once one has come


def on_stop(signum, frame):
    """The first INT, TERM or HUP stops the sweep (Runner.stop); a second one leaves at once."""
    if STOP:
        sys.exit(130)
    STOP.append(signum)


def read_commands(stream):
    """[(run name, its command)] from NUL-ended fields:
    a run's name, its command's length, its words."""
    fields = [os.fsdecode(f) for f in stream.read().split(b'\0')[:-1]]
    commands = []
    while fields:
        name, n = fields[0], int(fields[1])
        commands.append((name, fields[2:2 + n]))
        fields = fields[2 + n:]
    return commands


def time_left(walls, total, jobs):
    """'k of N ended, about T left': the ended runs' mean seconds x the runs to come / jobs."""
    t = sum(walls) / len(walls) * (total - len(walls)) / jobs
    left = f'{t:.0f} s' if t < 99 else f'{t / 60:.0f} min'
    return f'{len(walls)} of {total} ended, about {left} left'


def last_line(path):
    """The file's last line, as tail -n 1 prints it."""
    with open(path, 'rb') as f:
        text = f.read()
    return text.removesuffix(b'\n').rsplit(b'\n', 1)[-1].decode(errors='replace')


def alive(child):
    """Whether a process of the child's process group is left."""
    child.poll()  # reaps the child itself once it has ended: a zombie still counts
    try:
        os.killpg(child.pid, 0)
    except ProcessLookupError:
        return False
    return True


def elsewhere(run_dir):
    """Whether another process holds the run's .lock (which dies with its holder) or finished it."""
    if os.path.exists(os.path.join(run_dir, 'done.json')):
        return True
    try:
        fd = os.open(os.path.join(run_dir, '.lock'), os.O_RDONLY)
    except OSError:  # no .lock: nobody trains it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the lock this took
    return False


class Runner:
    """A sweep's runs as they train: at most jobs at once, each in a process group of its own."""

    def __init__(self, out, jobs, threads, gpus, total):
        self.out, self.jobs, self.threads, self.gpus, self.total = out, jobs, threads, gpus, total
        self.running = {}  # the train.py processes: their run's name and start time
        self.walls = []  # the seconds of each run that ended, for the time left
        self.failed, self.elsewhere = [], []  # runs: failed; trained by another process

    def log(self, name):
        return os.path.join(self.out, 'logs', name + '.log')

    def start(self, slot, name, command):
        """Start a run on GPU slot mod the number of GPUs, when there are any.
        Its log gets the command, then all that the run prints."""
        env = None
        if self.gpus:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.gpus[slot % len(self.gpus)])
        with open(self.log(name), 'a') as log:
            print(f'# {time.strftime("%a %b %e %H:%M:%S %Z %Y")}: {" ".join(command)}', file=log,
                  flush=True)
            # A session, so a process group, of its own: a Ctrl-C at the terminal reaches only
            # the sweep, which stops each run after its checkpoint (stop).
            child = subprocess.Popen([*command, f'--threads={self.threads}'], env=env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.running[child] = (name, time.monotonic())

    def next_ended(self):
        """The next run's process to end; on a stop signal, stop the sweep instead."""
        while True:
            if STOP:
                self.stop()
            for child in self.running:
                if child.poll() is not None:
                    return child
            time.sleep(0.1)

    def wait(self):
        """Wait until a run ends and say how: its seconds, the time left, a failed run's last log
        line (and a NAME.failed file next to its log)."""
        child = self.next_ended()
        name, t0 = self.running.pop(child)
        took = int(time.monotonic() - t0)
        self.walls.append(took)
        left = time_left(self.walls, self.total, self.jobs)
        if child.returncode == 0:
            print(f'done {name} in {took} s ({left})', flush=True)
        elif elsewhere(os.path.join(self.out, name)):
            print(f'elsewhere {name}: another process trains it ({left})', flush=True)
            self.elsewhere.append(name)
        else:
            print(f'FAILED {name} after {took} s ({left}): {last_line(self.log(name))}',
                  flush=True)
            open(os.path.join(self.out, 'logs', name + '.failed'), 'w').close()
            self.failed.append(name)

    def stop(self):
        """Signal each run's own process group (not the caller's): train.py checkpoints and stops.
        Wait until their processes are gone, then leave."""
        for child in self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        while any(alive(child) for child in self.running):
            time.sleep(1)
        print(f'sweep.sh: stopped; the same command resumes the runs in {self.out}',
              file=sys.stderr)
        sys.exit(130)


def run(commands, out, jobs, threads, gpus):
    """Train the runs of commands (read_commands) and say how each ended. Returns the runs that
    failed and those that another process trains and has not finished."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # as for bash's trap: ignored from the start stays so
        if signal.getsignal(s) != signal.SIG_IGN:
            signal.signal(s, on_stop)
    runner = Runner(out, jobs, threads, gpus, len(commands))
    for slot, (name, command) in enumerate(commands):
        while len(runner.running) >= jobs or STOP:
            runner.wait()
        runner.start(slot, name, command)
    while runner.running:
        runner.wait()
    unfinished = [name for name in runner.elsewhere
                  if not os.path.exists(os.path.join(out, name, 'done.json'))]
    return runner.failed, unfinished


def main(argv):
    """One step of sweep.sh: names, prepare or run (the module's docstring)."""
    step, *args = argv
    if step == 'check-env':
        check_env(os.environ)
    elif step == 'run-list':
        path, n_extra = args
        sys.stdout.buffer.write(b''.join(line + b'\n' for line in run_list(path, int(n_extra))))
    elif step == 'names':
        out, n_preset, n_extra, listed = args
        first = names(sys.stdin, out, int(n_preset), int(n_extra), listed)
        print('\n'.join(f'{i} {name}' for name, i in first.items()))
    elif step == 'prepare':
        prepare_data(args)
    elif step == 'run':
        out, jobs, threads, analyze, python, *gpus = args
        failed, unfinished = run(read_commands(sys.stdin.buffer), out, int(jobs), threads, gpus)
        if failed:
            print(f'{len(failed)} runs failed (logs in {out}/logs/); '
                  'fix the cause and run the same command again')
            sys.exit(1)
        if unfinished:  # the analysis waits for them: the sweep that ends last runs it
            print(f'{len(unfinished)} runs are still training elsewhere '
                  f'(another sweep into {out}?): no analysis here; '
                  'the sweep that ends last runs it, '
                  f'or run python analyze.py {out} once they are done')
        elif analyze == '1':
            sys.stdout.flush()
            os.execvp(python, [python, os.path.join(REPO, 'analyze.py'), out])
    else:
        sys.exit(f'sweep.py: unknown step {step!r}: check-env, run-list, names, prepare or run')


if __name__ == '__main__':
    main(sys.argv[1:])
