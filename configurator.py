"""
The configurator: train.py's settings from the defaults of its config block, then an optional config file,
then --key=value, each checked before any work (types, ranges, choices, a did-you-mean for near misses).

    python train.py my_config.py --seed=2

A config file holding a JSON object (recognised by its content, whatever the file's name) sets those keys.
Any other config file is executed as Python, as nanoGPT's configurator does: run only files you trust; its
top-level names are the settings. A config file that sets no known key is refused.

train.py calls get_config(argv, defaults, choices); nothing here is needed to change the science.
"""
import ast
import builtins
import difflib
import json
import math
import os
import types

import control as spectrum_control  # "control" is also a config key


class Stop(SystemExit):
    """A clean stop with one line for the user (a setting or input that cannot work, a full disk, a held lock,
    a NaN loss): train.py's main prints 'error: msg' and exits with status 2."""

    def __init__(self, msg):
        super().__init__(f'error: {msg}')
        self.msg = msg


# the valid range of every numeric setting, checked before any work: (settings, test, what it asks)
RANGES = [
    (('n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'grad_accum', 'eval_iters', 'eval_interval',
      'ckpt_interval', 'eval_windows', 'control_interval', 'min_char_count'), lambda v: v >= 1, 'at least 1'),
    (('max_iters', 'geom_interval', 'model_ckpts', 'warmup_iters', 'lr_decay_iters', 'shrink_iters', 'threads',
      'min_lr', 'weight_decay', 'grad_clip'), lambda v: v >= 0, '>= 0'),
    (('lr', 'shrink_to'), lambda v: v > 0, '> 0'),
    (('dropout', 'beta1', 'beta2'), lambda v: 0 <= v < 1, 'in [0, 1)'),
    (('seed',), lambda v: 0 <= v < 2 ** 32, 'in [0, 2**32) (numpy seeds are 32-bit)'),
]
# the choice settings that are not the model's (train.py adds qk_init from QK_INITS)
CHOICES = {'control': spectrum_control.KINDS, 'control_target': ('k', 'q'), 'control_scope': ('head', 'layer'),
           'control_keep': spectrum_control.KEEPS, 'dtype': ('auto', 'float32', 'bfloat16'),
           'dataset': ('wikitext103', 'wikitext103-test')}
FLOAT32_MAX = 3.4028234663852886e38
MAX_RECORDS = 1_000_000   # more records than this is a mistake (a metrics.jsonl of many GB), not a study


def did_you_mean(text, known):
    """'; did you mean X?' for the known name closest to text (its case aside), or ''."""
    low = str(text).strip().lower()
    close = [k for k in known if k == low] or difflib.get_close_matches(low, known, n=1)
    close = close or [k for k in known if low and (k.startswith(low) or low.startswith(k))]
    close = close or difflib.get_close_matches(low, known, n=1, cutoff=0.5)
    return f'; did you mean {close[0]}?' if close else ''


def read_utf8(path, what):
    """The text of a file, or one line saying it is not UTF-8 and where."""
    with open(path, 'rb') as f:
        data = f.read()
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise not_utf8(path, what, f'byte {e.start}: {data[e.start:e.start + 4]!r}') from None


def not_utf8(path, what, detail):
    return Stop(f'{what} {path} is not UTF-8 text ({detail}); convert it, for example with '
                f'iconv -f latin1 -t utf-8, or pass another file')


# ----------------------------------------------------------------------------- parsing

def parse_value(key, text, default):
    """Turn the text of --key=text into the type of the key's default, or say why not."""
    want = type(default)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare string such as --qk_init=tied
    if want is bool and isinstance(value, str) and value.lower() in ('true', 'false'):
        value = value.lower() == 'true'
    if want is float and type(value) is int:
        value = float(value)
    if want is str and not isinstance(value, str):
        value = text  # --run_name=123 is the string '123'
    if type(value) is not want:
        raise Stop(f'--{key}={text}: expected {want.__name__} (default {default!r}), got {value!r}')
    return value


def unknown_key(key, where, known):
    hint = did_you_mean(key, known) or '; see the config block at the top of train.py'
    return Stop(f'unknown config key {key!r} in {where}{hint}')


def config_file_values(path):
    """The settings a config file sets: a JSON object (recognised by content), else Python that is executed
    as nanoGPT's configurator does, its top-level names the settings (modules and functions left out)."""
    if not os.path.isfile(path):
        raise Stop(f'config file {path} does not exist')
    text = read_utf8(path, 'config file').removeprefix('\ufeff')  # a byte order mark some editors write
    if text.lstrip().startswith(('{', '[')):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise Stop(f'config file {path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})') from None
        if not isinstance(values, dict):
            raise Stop(f'config file {path} holds a JSON {type(values).__name__}; it must be a JSON object of '
                       f'settings, such as {{"n_layer": 4}}')
        return values
    namespace = {}
    try:
        exec(builtins.compile(text, path, 'exec'), namespace)
    except Exception as e:  # the file is the user's code: whatever it raises is its mistake, shown in one line
        detail = ' '.join(str(e).split())
        raise Stop(f'config file {path} failed as Python ({type(e).__name__}: {detail})') from None
    skip = (types.ModuleType, types.FunctionType, type)
    return {k: v for k, v in namespace.items() if not k.startswith('_') and not isinstance(v, skip)}


def load_config_file(path, defaults):
    """A config file's settings, each checked to be a known key with a value of its default's type."""
    values = config_file_values(path)
    if not values:
        raise Stop(f'config file {path} sets no config key; set at least one, e.g. n_layer = 4')
    for k, v in values.items():
        if k not in defaults:
            raise unknown_key(k, path, list(defaults))
        want = type(defaults[k])
        if not (type(v) is want or (want is float and type(v) is int)):
            raise Stop(f'{k}={v!r} in config file {path}: expected {want.__name__} (default {defaults[k]!r})')
        values[k] = want(v)
    return values


def get_config(argv, defaults, choices):
    """The defaults, then a config file, then --key=value; checked; with the run name resolved."""
    cfg = dict(defaults)
    for arg in argv:
        if not arg.startswith('--'):
            cfg.update(load_config_file(arg, defaults))
            continue
        key, eq, text = arg[2:].partition('=')
        if key not in defaults:
            raise unknown_key(key, 'the command line', list(defaults))
        if not eq:
            raise Stop(f'--{key} needs a value: --{key}=VALUE')
        cfg[key] = parse_value(key, text, defaults[key])
    check_config(cfg, {**CHOICES, **choices})
    if not cfg['run_name']:
        cfg['run_name'] = default_run_name(cfg)
    check_run_name(cfg['run_name'])
    return cfg


# ----------------------------------------------------------------------------- checks

def default_run_name(cfg):
    """The one source of run names: L4_normal_s1, L4_normal_shrink0.2-k_s1, L4_normal_freeze-k-spec_s3."""
    label = spectrum_control.control_label(cfg)
    return f"L{cfg['n_layer']}_{cfg['qk_init']}{'_' + label if label else ''}_s{cfg['seed']}"


def check_run_name(name):
    """A run name is one plain folder name: the run folder must lie inside out_dir."""
    seps = [s for s in (os.sep, os.altsep, '/') if s]
    if not name.strip() or name in ('.', '..') or any(s in name for s in seps) or not name.isprintable():
        raise Stop(f'run_name={name!r} must be one plain folder name inside out_dir (no path separator, no '
                   f'newline or other control character, not . or .., not blank), for example --run_name=my_run')
    if name == 'analysis':
        raise Stop("run_name='analysis' is the folder analyze.py writes its tables into by default; choose "
                   "another --run_name")


def check_config(cfg, choices):
    """Stop before any work on settings that cannot run, saying which and how to fix them."""
    for key, valid in choices.items():
        if cfg[key] not in valid:
            raise Stop(f"{key}={cfg[key]!r} is not one of {', '.join(valid)}{did_you_mean(cfg[key], valid)}")
    for key, value in cfg.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise Stop(f'{key}={value} must be a finite number')
    for keys, ok, words in RANGES:
        for key in keys:
            if not ok(cfg[key]):
                raise Stop(f'{key}={cfg[key]} must be {words}')
    if cfg['n_embd'] % cfg['n_head']:
        raise Stop(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}; "
                   f"pick n_head among {[h for h in range(1, 17) if cfg['n_embd'] % h == 0]}")
    if 0 < cfg['lr_decay_iters'] < cfg['warmup_iters']:
        raise Stop(f"lr_decay_iters={cfg['lr_decay_iters']} ends the decay before the warm-up ends "
                   f"(warmup_iters={cfg['warmup_iters']}); use 0 (= max_iters) or at least warmup_iters")
    n = cfg['max_iters'] // cfg['eval_interval'] + (cfg['max_iters'] // cfg['geom_interval'] if cfg['geom_interval']
                                                    else 0)
    if n > MAX_RECORDS:
        raise Stop(f"max_iters={cfg['max_iters']} with eval_interval={cfg['eval_interval']} and geom_interval="
                   f"{cfg['geom_interval']} asks for about {n:,} records (at most {MAX_RECORDS:,}); raise the "
                   f"intervals or lower max_iters")
    step = cfg['lr'] / (1 - cfg['beta1'])  # AdamW's first step, lr / (1 - beta1), is applied as a float32
    if step > FLOAT32_MAX:
        raise Stop(f"lr={cfg['lr']} makes AdamW's first step lr / (1 - beta1) = {step:.3g} overflow float32 (at most "
                   f"{FLOAT32_MAX:.3g}); use a learning rate below {FLOAT32_MAX * (1 - cfg['beta1']):.3g}")
    if cfg['min_lr'] > cfg['lr']:
        raise Stop(f"min_lr={cfg['min_lr']} must not exceed lr={cfg['lr']}: the schedule decays from lr to min_lr")
    try:  # control_layers, shrink_to, shrink_iters
        spectrum_control.check_settings(cfg, cfg['n_layer'])
    except ValueError as e:
        raise Stop(str(e)) from None


def print_run_names(lines, get_config):
    """`python train.py --print_run_names`: one argument list per input line, its resolved run name per
    output line; every line is checked before anything is printed. Loads no data, touches no folder."""
    names = []
    for n, line in enumerate(lines, 1):
        try:
            names.append(get_config(line.split())['run_name'])
        except Stop as e:
            raise Stop(f'--print_run_names: input line {n} ({line.strip()!r}): {e.msg}') from None
    print('\n'.join(names))


def usage(source):
    """`python train.py --help`: every option with its default and its comment, grouped as the config block
    of the file `source` is (its lines between the two dashed rules after 'config:')."""
    lines = open(source, encoding='utf-8').read().split('\n')
    start = next(i for i, line in enumerate(lines) if line.startswith('# config:'))
    out = ['usage: python train.py [CONFIG_FILE] [--key=value ...]   (or --print_run_names, reading stdin)', '']
    for line in lines[start + 1:]:
        if line.startswith('config_keys') or line.startswith('# ---'):
            break
        if line.startswith('# '):
            out.append(f'{line[2:]}:')
            continue
        code, _, comment = line.partition('  # ')
        key, _, default = code.partition('=')
        out.append(f'  --{key.strip()}={default.strip()}'.ljust(36) + f' {comment.strip()}'.rstrip())
    return '\n'.join(out)
