"""
train.py's settings: the defaults of its config block, then config files, then --key=value (which always
wins). A config file ending in .json is a JSON object; any other is Python, executed as nanoGPT's
configurator does (run only files you trust), its top-level names the settings.
"""
import ast
import contextlib
import difflib
import hashlib
import json
import os


class Stop(SystemExit):
    """A clean stop with one line for the user: train.py prints 'error: msg' and exits with status 2."""
    def __init__(self, msg):
        super().__init__(f'error: {msg}')
        self.msg = msg


POSITIVE = range(1, 1 << 62)
# the values a setting may take where its type allows more (train.py adds qk_init, optimizer and the control's):
# counts, intervals and sizes are positive (geom_interval, model_ckpts, max_iters and threads may be 0)
CHOICES = {'dtype': ('auto', 'float32', 'bfloat16'), 'dataset': ('wikitext103', 'wikitext103-test'), **dict.fromkeys((
               'n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'grad_accum', 'eval_interval', 'eval_iters',
               'eval_windows', 'ckpt_interval', 'control_interval', 'min_char_count'), POSITIVE)}
# where things are and how fast, not what is computed: left out of the run name's settings hash
NOT_IN_NAME = ('out_dir', 'run_name', 'overwrite', 'device', 'threads', 'compile', 'cache_dir', 'data_dir', 'data_url',
               'ckpt_interval')
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
    text, namespace = open(path, encoding='utf-8').read(), {}
    try:
        if path.endswith('.json'):
            return json.loads(text)
        exec(compile(text, path, 'exec'), namespace)
    except (ValueError, SyntaxError) as e:  # a JSONDecodeError is a ValueError
        raise Stop(f"config file {path} line {getattr(e, 'lineno', '?')}: {getattr(e, 'msg', e)}") from None
    return {k: v for k, v in namespace.items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))}


def get_config(argv, defaults, choices, check=None):
    """defaults <- config files (in order) <- --key=value (in order, always last); checked (check(cfg) may raise a
    ValueError naming a setting); run name resolved."""
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
    for key, valid in {**CHOICES, **choices}.items():
        if key in cfg and cfg[key] not in valid:
            raise Stop(f'{key}={cfg[key]!r}: expected ' + ('an integer >= 1' if valid is POSITIVE else
                                                           f"one of {', '.join(valid)}"))
    if cfg['n_embd'] % cfg['n_head']:
        raise Stop(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}")
    try:
        check and check(cfg)
    except ValueError as e:
        raise Stop(str(e)) from None
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
    other = {k: v for k, v in cfg.items() if k not in NOT_IN_NAME + NAMED and v != defaults[k]}
    if other:
        name += '-' + hashlib.sha1(json.dumps(other, sort_keys=True).encode()).hexdigest()[:6]
    return name

