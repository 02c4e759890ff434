"""
train.py's settings: the defaults of its config block, then config files, then --key=value (which always
wins), each checked against train.py's SETTINGS table before anything is touched. A config file ending in .json
is a JSON object; any other is Python, executed as nanoGPT's configurator does (run only files you trust), its
top-level names the settings.
"""
import ast
import contextlib
import difflib
import hashlib
import json
import math
import os


class Stop(SystemExit):
    """A clean stop with one line for the user: train.py prints 'error: msg' and exits with status 2."""
    def __init__(self, msg):
        super().__init__(f'error: {msg}')
        self.msg = msg


# where things are and how fast, not what is computed: left out of the run name's settings hash (data_file is in
# it by its content, as data_sha256)
NOT_IN_NAME = ('out_dir', 'run_name', 'overwrite', 'device', 'threads', 'compile', 'cache_dir', 'data_dir', 'data_url',
               'ckpt_interval', 'data_file')
# in the readable part of the run name
NAMED = ('n_layer', 'qk_init', 'control', 'control_target', 'control_keep', 'shrink_to', 'seed')


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
    except (ValueError, SyntaxError) as e:  # a JSONDecodeError and a UnicodeDecodeError are ValueErrors
        where = f" line {e.lineno}" if getattr(e, 'lineno', None) else ''
        raise Stop(f"config file {path}{where}: {getattr(e, 'msg', e)}") from None
    return {k: v for k, v in namespace.items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))}


def in_interval(value, spec):
    """Whether a number lies in an interval written as '[0, 1)', '(0, inf)' or '[1, 1e9]'."""
    lo, hi = (float(end) for end in spec[1:-1].split(','))
    return (lo <= value if spec[0] == '[' else lo < value) and (value <= hi if spec[-1] == ']' else value < hi)


def check(cfg, table):
    """Every setting against its row of the table: an interval, a tuple of choices, a function of the config that
    returns what is wrong (or nothing), or a list of these; any float must be finite. A Stop names the setting."""
    for key, value in cfg.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise Stop(f'{key}={value}: expected a finite number')
        row = table.get(key, [])
        for spec in row if isinstance(row, list) else [row]:
            if isinstance(spec, str) and not in_interval(value, spec):
                raise Stop(f"{key}={value!r}: expected {'an integer' if type(value) is int else 'a number'} in {spec}")
            if isinstance(spec, tuple) and value not in spec:
                raise Stop(f"{key}={value!r}: expected one of {', '.join(spec)}")
            try:
                problem = callable(spec) and spec(cfg)
            except ValueError as e:  # a check that names the setting itself
                raise Stop(str(e)) from None
            if problem:
                raise Stop(f'{key}={value!r}: {problem}')


def get_config(argv, defaults, table):
    """defaults <- config files (in order) <- --key=value (in order, always last); checked against the table; the
    text of data_file identified by its content; the run name resolved."""
    files = [a for a in argv if not a.startswith('--')]
    pairs = [a[2:].partition('=') for a in argv if a.startswith('--')]
    cfg = dict(defaults)
    for key, eq, _ in pairs:
        if not eq:
            raise Stop(f'--{key} needs a value: --{key}=VALUE')
    updates = [(k, v, None) for path in files for k, v in file_settings(path).items()]
    for key, value, text in updates + [(key, None, text) for key, _, text in pairs]:
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            raise Stop(f"unknown config key {key!r}" + (f"; did you mean {close[0]}?" if close else ''))
        cfg[key] = typed(key, value, defaults[key], text)
    check(cfg, table)
    if cfg['data_file']:  # a link or another spelling of the same path is the same text
        if not os.path.isfile(cfg['data_file']):
            raise Stop(f"data_file={cfg['data_file']} is not a file")
        import prepare  # prepare.py imports this module
        cfg['data_sha256'] = prepare.sha256_of([cfg['data_file']])
    name = cfg['run_name'] = cfg['run_name'] or run_name(cfg, defaults)
    if name in ('.', '..') or '/' in name or os.sep in name or not name.isprintable():
        raise Stop(f'run_name={name!r} must be one plain folder name inside out_dir')
    return cfg


def run_name(cfg, defaults):
    """L4_normal_s1, L4_normal_shrink0.2-k_s1, L4_normal_freeze-k-spec_s3, then '-' and a short hash of every
    other setting that differs from its default, so that runs differing in any key never share a folder."""
    control = ''
    if cfg['control'] != 'none':
        dose = f"{cfg['shrink_to']:g}" if cfg['control'] == 'shrink' else ''
        keep = '-spec' if cfg['control_keep'] == 'spec' else ''
        control = f"_{cfg['control']}{dose}-{cfg['control_target']}{keep}"
    name = f"L{cfg['n_layer']}_{cfg['qk_init']}{control}_s{cfg['seed']}"
    other = {k: v for k, v in cfg.items() if k not in NOT_IN_NAME + NAMED and v != defaults.get(k)}
    if other:
        name += '-' + hashlib.sha1(json.dumps(other, sort_keys=True).encode()).hexdigest()[:6]
    return name
