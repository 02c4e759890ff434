"""sweep.sh's Python: it checks and names every run of a sweep before anything runs, prepares the
data once, and trains the runs on this machine. sweep.sh runs it as a script, one step a call:

    python plumbing/sweep.py run-list RUN_LIST N_EXTRA
    python plumbing/sweep.py names OUT N_PRESET N_EXTRA RUN_LIST < runs
    python plumbing/sweep.py prepare --key=value ...
    python plumbing/sweep.py run OUT JOBS THREADS ANALYZE PYTHON [GPU ...] < commands

names reads one run a line, its train.py arguments shell-quoted: the preset's N_PRESET, the grid
line's, then sweep.sh's N_EXTRA extra arguments (with a RUN_LIST, its path, the grid line is a line
of that file; '' for none). It prints 'INDEX NAME' for the first line of each run. run reads
NUL-ended fields: each run's name, the length of its command, its command. A stop is one line on
stderr, sweep.sh's (or train.py's about a setting), and exit status 1 (sweep.sh exits 2).
"""
import contextlib
import glob
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

if __name__ == '__main__':
    # as a script, Python puts plumbing/ first on sys.path; the root goes there instead, so that
    # this imports as train.py does, from any working directory (and no plumbing module as a
    # top-level one)
    if sys.path and os.path.realpath(sys.path[0]) == PLUMBING:
        sys.path[0] = REPO
    else:
        sys.path.insert(0, REPO)

train = configurator = None  # imported by load(): only names and prepare need them, and torch


def load():
    """Import train.py and the configurator (and torch), or stop naming the module this Python
    lacks."""
    global train, configurator
    try:
        import train
        from plumbing import configurator
    except ModuleNotFoundError as e:  # most often torch: a Python outside the project's venv
        sys.exit(f'sweep.sh: {sys.executable} has no {e.name}: '
                 f'activate its venv or set PYTHON=/path/to/venv/bin/python')


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


def check_finished(cfg, out):
    """Stop if the run is finished under out with other settings than cfg's: the sweep would skip
    it, and keep a run that is not the one asked for."""
    run = os.path.join(out, cfg['run_name'])
    if not os.path.exists(os.path.join(run, 'done.json')):
        return
    with open(os.path.join(run, 'config.json')) as f:
        old = json.load(f)
    # every setting but where and how fast (NOT_IN_NAME); config.json holds the dtype that
    # auto chose
    diff = '; '.join(f'{k} {old.get(k)} there, {v} here' for k, v in cfg.items()
                     if old.get(k) != v and k not in configurator.NOT_IN_NAME
                     and (k, v) != ('dtype', 'auto'))
    if diff:
        sys.exit(f'sweep.sh: {run} is finished with other settings ({diff}): '
                 f'move it away or rename the run')


def names(lines, out, n_preset, n_extra, listed):
    """{run name: the index of its first line} of the runs of lines, each checked by train.py; a
    later line with a name listed before is the same run, trained once."""
    load()
    first = {}
    for i, line in enumerate(lines):
        args = shlex.split(line)
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
    """[(run name, its command)] from NUL-ended fields: a run's name, its command's length, its
    words."""
    fields = [os.fsdecode(f) for f in stream.read().split(b'\0')[:-1]]
    commands = []
    while fields:
        name, n = fields[0], int(fields[1])
        commands.append((name, fields[2:2 + n]))
        fields = fields[2 + n:]
    return commands


def time_left(walls, total, jobs):
    """'k of N ended, about T left': the mean seconds of the k runs ended, times the runs to come,
    over the runs at once."""
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


class Runner:
    """A sweep's runs as they train: at most jobs at once, each in a process group of its own."""

    def __init__(self, out, jobs, threads, gpus, total):
        self.out, self.jobs, self.threads, self.gpus, self.total = out, jobs, threads, gpus, total
        self.running = {}  # the train.py processes: their run's name and start time
        self.walls = []  # the seconds of each run that ended, for the time left

    def log(self, name):
        return os.path.join(self.out, 'logs', name + '.log')

    def start(self, slot, name, command):
        """Start a run on GPU slot mod the number of GPUs when there are any; its log gets the
        command and then all that it prints."""
        env = None
        if self.gpus:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.gpus[slot % len(self.gpus)])
        with open(self.log(name), 'a') as log:
            print(f'# {time.strftime("%a %b %e %H:%M:%S %Z %Y")}: {" ".join(command)}', file=log,
                  flush=True)
            # a session, so a process group, of its own: a Ctrl-C at the terminal reaches the sweep
            # only, which stops each run after its checkpoint (stop)
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
            return
        print(f'FAILED {name} after {took} s ({left}): {last_line(self.log(name))}', flush=True)
        open(os.path.join(self.out, 'logs', name + '.failed'), 'w').close()

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
    """Train the runs of commands (read_commands) and say how each ended; the number that failed."""
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
    return len(glob.glob(os.path.join(glob.escape(out), 'logs', '*.failed')))


def main(argv):
    """One step of sweep.sh: names, prepare or run (the module's docstring)."""
    step, *args = argv
    if step == 'run-list':
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
        failed = run(read_commands(sys.stdin.buffer), out, int(jobs), threads, gpus)
        if failed:
            print(f'{failed} runs failed (logs in {out}/logs/); fix the cause and run the same '
                  f'command again')
            sys.exit(1)
        if analyze == '1':
            sys.stdout.flush()
            os.execvp(python, [python, os.path.join(REPO, 'analyze.py'), out])
    else:
        sys.exit(f'sweep.py: unknown step {step!r}: run-list, names, prepare or run')


if __name__ == '__main__':
    main(sys.argv[1:])
