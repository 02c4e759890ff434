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


# the settings with a fixed set of values (train.py adds qk_init and optimizer from its own tables)
CHOICES = {'control': ('none', 'shrink', 'freeze'), 'control_target': ('k', 'q'), 'control_scope': ('head', 'layer'),
           'control_keep': ('fro', 'spec'), 'dtype': ('auto', 'float32', 'bfloat16'),
           'dataset': ('wikitext103', 'wikitext103-test')}
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
    with open(path, encoding='utf-8') as f:
        text = f.read()
    if path.endswith('.json'):
        return json.loads(text)
    namespace = {}
    exec(compile(text, path, 'exec'), namespace)
    return {k: v for k, v in namespace.items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))}


def get_config(argv, defaults, choices):
    """defaults <- config files (in order) <- --key=value (in order, always last); checked; run name resolved."""
    files = [a for a in argv if not a.startswith('--')]
    pairs = [a[2:].partition('=') for a in argv if a.startswith('--')]
    cfg = dict(defaults)
    updates = [(k, v, None) for path in files for k, v in file_settings(path).items()]
    for key, eq, text in pairs:
        if not eq:
            raise Stop(f'--{key} needs a value: --{key}=VALUE')
        updates.append((key, None, text))
    for key, value, text in updates:
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            raise Stop(f"unknown config key {key!r}" + (f"; did you mean {close[0]}?" if close else ''))
        cfg[key] = typed(key, value, defaults[key], text)
    for key, valid in {**CHOICES, **choices}.items():
        if cfg[key] not in valid:
            raise Stop(f"{key}={cfg[key]!r} is not one of {', '.join(valid)}")
    if cfg['n_embd'] % cfg['n_head']:
        raise Stop(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}")
    cfg['run_name'] = cfg['run_name'] or run_name(cfg, defaults)
    name = cfg['run_name']
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


def usage(source):
    """--help: the config block of train.py, every key with its default and comment."""
    text = open(source, encoding='utf-8').read()
    return ('usage: python train.py [CONFIG_FILE ...] [--key=value ...]\n'
            + text[text.index('# config'):text.index('config_keys')])
