"""
train.py's settings: its config block, then config files, then --key=value, checked against
SETTINGS before anything is touched. A .json config file is a JSON object; any other is Python,
run as nanoGPT's (only files you trust).
"""
import ast
import contextlib
import difflib
import hashlib
import io
import json
import math
import os
import tokenize

import control as spectrum_control   # "control" is also a config key


class Stop(SystemExit):
    """A clean stop with one line for the user: train.py prints 'error: ' and it, and exits 2."""


# where things are and how fast, not what is computed: left out of the run name's hash, and free
# to change when a run resumes (the text of data_file is in both by its content, as data_sha256)
NOT_IN_NAME = ('out_dir', 'run_name', 'overwrite', 'device', 'threads', 'compile', 'cache_dir',
               'data_dir', 'data_url', 'ckpt_interval', 'data_file', 'wandb_log', 'wandb_project',
               'wandb_run_name')
# in the readable part of the run name
NAMED = ('n_layer', 'qk_init', 'control', 'control_target', 'control_keep', 'shrink_to', 'seed')
HASHES = {}  # the files' (path, size, time) -> their SHA-256


def typed(key, value, default, text=None):
    """value, or the text of --key=text, as the type of the key's default, or a Stop naming both."""
    want = type(default)
    if text is not None:
        if want is str:
            return text  # --run_name=123 is the string '123'
        with contextlib.suppress(ValueError, SyntaxError):
            text = ast.literal_eval(text)
        value = text
    if want is bool and isinstance(value, str) and value.lower() in ('true', 'false'):
        return value.lower() == 'true'
    if want is float and type(value) is int:
        return float(value)
    if type(value) is not want:
        raise Stop(f'{key}={value!r}: expected {want.__name__} (default {default!r})')
    return value


def file_settings(path):
    if not os.path.isfile(path):
        raise Stop(f'config file {path} does not exist')
    namespace = {}
    try:
        text = open(path, encoding='utf-8').read()
        if path.endswith('.json'):
            settings = json.loads(text)
            if not isinstance(settings, dict):
                raise ValueError('expected a JSON object, {"key": value, ...}')
            return settings
        exec(compile(text, path, 'exec'), namespace)
    except (ValueError, SyntaxError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        where = f" line {e.lineno}" if getattr(e, 'lineno', None) else ''
        raise Stop(f"config file {path}{where}: {getattr(e, 'msg', e)}") from None
    return {k: v for k, v in namespace.items()
            if not k.startswith('_') and isinstance(v, (bool, int, float, str))}


def check(cfg, table, names):
    """Each setting against its row of the table: its choices (a tuple or a dict), or a Python
    condition on the settings (and names); any other float must be finite.
    A Stop names the first setting that fails, and the values its row reads."""
    for key, value in cfg.items():
        row = table.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            raise Stop(f'{key}={value}: expected a finite number')
        if isinstance(row, (tuple, dict)) and value not in row:
            raise Stop(f"{key}={value!r}: expected one of {', '.join(row)}")
        try:
            if not isinstance(row, str) or eval(row, names, dict(cfg)):
                continue
        except ValueError as e:  # a check that names the setting itself
            raise Stop(str(e)) from None
        others = [n for n in compile(row, '', 'eval').co_names
                  if n != key and (n in cfg or isinstance(names.get(n), dict))]
        read = [f'{n}={cfg[n]}' if n in cfg else f"{n}: {', '.join(names[n])}" for n in others]
        raise Stop(f'{key}={value!r}: expected {row}' + (f" ({'; '.join(read)})" if read else ''))


def get_config(argv, defaults, table, names):
    """defaults <- config files <- --key=value, checked against table, with the run named."""
    files = [a for a in argv if not a.startswith('--')]
    pairs = [a[2:].partition('=') for a in argv if a.startswith('--')]
    cfg = dict(defaults)
    for key, eq, _ in pairs:
        if not eq:
            raise Stop(f'--{key} needs a value: --{key}=VALUE '
                       '(every setting: python train.py --help)')
    updates = [(k, v, None) for path in files for k, v in file_settings(path).items()]
    for key, value, text in updates + [(key, None, text) for key, _, text in pairs]:
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            hint = f'; did you mean {close[0]}?' if close else ''
            raise Stop(f'unknown config key {key!r}{hint}')
        cfg[key] = typed(key, value, defaults[key], text)
    check(cfg, table, names)
    if cfg['data_file']:  # a link or another spelling of the same path is the same text
        cfg['data_sha256'] = sha256_of([cfg['data_file']])
    cfg['run_name'] = cfg['run_name'] or run_name(cfg, defaults)
    return cfg


def sha256_of(paths):
    """The SHA-256 of the files' bytes, remembered while they keep their size and time:
    get_config and prepare_data both ask for it."""
    stamps = tuple((os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths)
    if stamps not in HASHES:
        h = hashlib.sha256()
        for path, _, _ in stamps:
            with open(path, 'rb') as f:
                while block := f.read(1 << 24):
                    h.update(block)
        HASHES[stamps] = h.hexdigest()
    return HASHES[stamps]


def run_name(cfg, defaults):
    """L4_normal_s1, L4_normal_freeze-k-spec_s3, ..., then a hash of other non-default settings."""
    control = f"_{spectrum_control.label(cfg)}" if cfg['control'] != 'none' else ''
    name = f"L{cfg['n_layer']}_{cfg['qk_init']}{control}_s{cfg['seed']}"
    other = {k: v for k, v in cfg.items() if k not in NOT_IN_NAME + NAMED and v != defaults.get(k)}
    if other:
        name += '-' + hashlib.sha1(json.dumps(other, sort_keys=True).encode()).hexdigest()[:6]
    return name


def help_text(path, keys):
    """The config block of the file at path, as --help prints it: each of keys with its default and
    its inline comment, under the block's one-line headers (comment lines between its settings)."""
    source = open(path, encoding='utf-8').read()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {t.start[0]: t.string.lstrip('# ') for t in tokens if t.type == tokenize.COMMENT}
    settings = {node.lineno: node for node in ast.parse(source).body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', None) in keys}
    lines = source.splitlines()
    out = ['settings: --key=value or a config file; the default, then what it means']
    for n in range(min(settings) - 1, max(settings) + 1):
        if n in settings:
            key, value = settings[n].targets[0].id, settings[n].value
            comment = comments.get(settings[n].end_lineno, '')
            out.append(f'  {key:<16} {ast.get_source_segment(source, value):<12} {comment}')
        elif lines[n - 1].lstrip().startswith('#'):
            out.append(comments[n])
    return '\n'.join(line.rstrip() for line in out)
