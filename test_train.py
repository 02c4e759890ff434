"""Tests of train.py on small synthetic text: config, data, model inits, run folder, determinism."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import geometry
import prepare
import runfolder
import train
from configurator import Stop

HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------- config

def test_overrides_take_the_type_of_the_default(tmp_path, text_file, tiny_config):
    """Overrides are parsed into the type of the default; the run name follows the settings."""
    cfg = tiny_config(tmp_path, text_file, '--lr=3e-4', '--decay_qk=False', '--qk_init=tied', '--max_iters=7')
    assert cfg['lr'] == 3e-4 and cfg['decay_qk'] is False and cfg['qk_init'] == 'tied' and cfg['max_iters'] == 7
    assert cfg['run_name'] == 'L2_tied_s1'
    assert train.get_config(['--weight_decay=0'])['weight_decay'] == 0.0  # an int is fine for a float
    assert train.get_config(['--control=shrink', '--seed=3'])['run_name'] == 'L4_normal_shrink0.5-k_s3'


def test_unknown_key_names_the_closest_known_key():
    """An unknown key names the closest known key."""
    with pytest.raises(SystemExit, match="unknown config key 'n_layr'.*did you mean n_layer"):
        train.get_config(['--n_layr=4'])


@pytest.mark.parametrize('arg, words', [('--n_layer=four', 'expected int'), ('--n_layer=2.5', 'expected int'),
                                        ('--lr=fast', 'expected float'), ('--compile=maybe', 'expected bool'),
                                        ('--n_layer', 'needs a value')])
def test_wrong_types_are_refused(arg, words):
    """A value of the wrong type, or a key without a value, is refused naming the key."""
    with pytest.raises(SystemExit, match=words):
        train.get_config([arg])


@pytest.mark.parametrize('arg, words', [('--n_embd=100', 'not divisible by n_head'),
                                        ('--qk_init=random', 'not one of'), ('--control=grow', 'not one of'),
                                        ('--dtype=float16', 'not one of'), ('--batch_size=0', 'at least 1'),
                                        # a schedule of 2e9 records, and an lr whose first AdamW step overflows
                                        ('--max_iters=2000000000 --eval_interval=1', 'at most 1,000,000'),
                                        ('--lr=1e38 --warmup_iters=0', 'overflow float32')])
def test_impossible_settings_stop_before_training(arg, words):
    """Settings that cannot run are refused in get_config, before any work."""
    with pytest.raises(SystemExit, match=words):
        train.get_config(arg.split())


def test_run_names_come_from_the_settings_and_control_label():
    """default_run_name is the one source of run names; its control part is control.control_label."""
    names = [train.get_config(args)['run_name'] for args in (
        [], ['--control=shrink'], ['--control=freeze', '--control_keep=spec', '--seed=3'],
        ['--n_layer=6', '--qk_init=tied', '--control=shrink', '--control_target=q', '--shrink_to=0.1'])]
    assert names == ['L4_normal_s1', 'L4_normal_shrink0.5-k_s1', 'L4_normal_freeze-k-spec_s3', 'L6_tied_shrink0.1-q_s1']


def test_print_run_names_reads_argument_lists_from_stdin(tmp_path):
    """--print_run_names: one resolved name per input line, exit 0, no folder made; a bad line is named."""
    lines = ['--n_layer=6 --qk_init=tied', '', '--control=freeze --control_keep=spec --seed=3',
             f'--run_name=mine --out_dir={tmp_path / "out"}']
    proc = subprocess.run([sys.executable, 'train.py', '--print_run_names'], input='\n'.join(lines) + '\n',
                          cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split('\n') == [train.get_config(line.split())['run_name'] for line in lines] + ['']
    assert not os.path.exists(tmp_path / 'out')
    proc = subprocess.run([sys.executable, 'train.py', '--print_run_names'], input='--seed=2\n--qk_init=ortho\n',
                          cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ''
    assert proc.stderr.count('\n') == 1 and "input line 2 ('--qk_init=ortho')" in proc.stderr


@pytest.mark.parametrize('name', ['../v', '/tmp/abs', '.', '..', 'a/b', '  ', 'a\\0b'.replace('\\0', chr(0)),
                                  'a\nb', 'analysis'])
def test_run_name_cannot_leave_out_dir(name):
    """A run name with a separator, '.', '..', an absolute path or no visible character is refused."""
    with pytest.raises(Stop, match='run_name'):
        train.get_config([f'--run_name={name}'])


@pytest.mark.parametrize('arg, key', [('--lr=-1', 'lr'), ('--seed=-1', 'seed'), ('--threads=-1', 'threads'),
                                      ('--dropout=1.5', 'dropout'), ('--lr_decay_iters=-5', 'lr_decay_iters'),
                                      ('--lr_decay_iters=50', 'lr_decay_iters'), ('--lr=1e999', 'lr'),
                                      ('--beta2=1.0', 'beta2'), ('--min_lr=-1e-4', 'min_lr'),
                                      ('--min_lr=0.1', 'min_lr'), ('--weight_decay=-0.1', 'weight_decay'),
                                      ('--grad_clip=-1', 'grad_clip'), ('--model_ckpts=-1', 'model_ckpts'),
                                      ('--min_char_count=0', 'min_char_count'), ('--warmup_iters=-1', 'warmup_iters'),
                                      ('--seed=4294967296', 'seed'), ('--eval_windows=0', 'eval_windows')])
def test_numeric_settings_out_of_range_are_refused_before_training(arg, key):
    """Every numeric setting is range-checked in get_config, naming the key (no traceback later)."""
    with pytest.raises(Stop, match=f'^error: {key}='):
        train.get_config([arg])


@pytest.mark.parametrize('arg, hint', [('--qk_init=ortho', 'orthogonal'), ('--control=shrnk', 'shrink'),
                                       ('--control_target=K', 'k'), ('--control_scope=heads', 'head'),
                                       ('--control_keep=spectral', 'spec'), ('--dtype=bf16', 'bfloat16'),
                                       ('--dataset=wikitext', 'wikitext103')])
def test_choice_settings_get_a_did_you_mean_hint(arg, hint):
    """A misspelt choice names the closest valid one, as an unknown key does."""
    with pytest.raises(Stop, match=f'not one of .*did you mean {hint}\\?'):
        train.get_config([arg])


@pytest.mark.parametrize('name, text, words', [
    ('bad.json', '{"n_layer": 2,', 'not valid JSON'), ('list.json', '[2, 4]', 'JSON object'),
    ('list_value.json', '{"n_layer": [2, 4]}', 'expected int'),
    ('str_value.json', '{"qk_init": ["tied"]}', 'expected str'),
    ('syntax.py', 'n_layer = = 2', 'SyntaxError'), ('raises.py', 'n_layer = 1 / 0', 'ZeroDivisionError'),
    ('nothing.py', '# n_layer = 2\n_private = 3\n', 'sets no config key'), ('empty.json', '{}', 'sets no config key'),
    ('latin1.py', b'qk_init = "caf\xe9"', 'not UTF-8')])
def test_malformed_config_files_are_named(tmp_path, name, text, words):
    """Malformed JSON, a JSON list, values of the wrong type, Python that fails, a file
    that sets no known key and invalid UTF-8 each give one line naming the file."""
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(Stop, match=words) as e:
        train.get_config([str(path)])
    assert str(path) in e.value.msg and '\n' not in e.value.msg


def test_help_prints_every_option_with_its_default_grouped_as_the_config_block():
    """--help and -h print the usage: every config key with its default and its comment, under the group headers
    of the config block; exit status 0."""
    for flag in ('--help', '-h'):
        proc = subprocess.run([sys.executable, 'train.py', flag], cwd=HERE, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stderr == '', proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith('usage: python train.py')
        for key in train.config_keys:
            line = next(x for x in lines if x.strip().startswith(f'--{key}='))
            assert len(line.split()) > 1, line  # a comment after the default
        n_layer = lines.index('  --n_layer=4                        transformer blocks')
        assert lines.index('model:') < n_layer < lines.index('optimizer:')


def test_a_json_config_with_a_byte_order_mark_is_read_as_json(tmp_path):
    """A JSON config saved with a UTF-8 byte order mark is JSON, not Python."""
    path = tmp_path / 'cfg.json'
    path.write_bytes('{"n_layer": 3}'.encode('utf-8-sig'))
    assert train.get_config([str(path)])['n_layer'] == 3


def test_json_config_is_recognised_by_content_and_python_is_executed(tmp_path):
    """A JSON object in a file of any name is read as JSON; a Python file runs as Python."""
    (tmp_path / 'my.cfg').write_text('  {"n_layer": 2, "qk_init": "tied", "lr": 1}\n')
    cfg = train.get_config([str(tmp_path / 'my.cfg')])
    assert (cfg['n_layer'], cfg['qk_init'], cfg['lr']) == (2, 'tied', 1.0)
    (tmp_path / 'my.py').write_text('import math\nn_embd = 2 ** 7 * 3\nlr = math.sqrt(1e-6)\n')
    cfg = train.get_config([str(tmp_path / 'my.py')])
    assert cfg['n_embd'] == 384 and cfg['lr'] == pytest.approx(1e-3)


def test_config_file_then_command_line(tmp_path):
    """A Python config file sets keys, the command line overrides it; an unknown key in a JSON file is named
    with its closest key."""
    path = tmp_path / 'small.py'
    path.write_text("n_layer = 2\nn_embd = 96\nqk_init = 'orthogonal'\n")
    cfg = train.get_config([str(path), '--n_layer=3'])
    assert (cfg['n_layer'], cfg['n_embd'], cfg['qk_init']) == (3, 96, "orthogonal")
    (tmp_path / 'bad.json').write_text('{"n_heads": 4}')
    with pytest.raises(SystemExit, match="unknown config key 'n_heads'.*n_head"):
        train.get_config([str(tmp_path / 'bad.json')])


# ----------------------------------------------------------------------------- metrics.jsonl

def test_read_metrics_drops_a_cut_last_line_and_names_any_other_bad_one(tmp_path):
    """A kill mid-write leaves a cut last line: dropped silently. Any other bad line (not JSON, not UTF-8,
    not a record) stops with one line naming file and line, or with warn is reported and skipped."""
    path = tmp_path / 'metrics.jsonl'
    good = [json.dumps({'iter': i, 'val_loss': 1.0}) for i in range(3)]
    path.write_text('\n'.join(good) + '\n{"iter": 3, "val_lo')
    assert [r['iter'] for r in runfolder.read_metrics(str(path))] == [0, 1, 2]
    warnings = []  # a reader that asks (the analysis of a finished run) is told the last record is lost
    assert [r['iter'] for r in runfolder.read_metrics(str(path), warnings.append)] == [0, 1, 2]
    assert warnings == [f'{path} line 4 is cut short (a kill while it was written?): that record is lost']
    assert runfolder.read_metrics(str(tmp_path / 'absent.jsonl')) == []
    for bad in (b'{"iter": 1, "val', b'\xff\xfe{"iter": 1}', b'[1, 2]', b'{"iter": "one"}'):
        path.write_bytes(b'\n'.join([good[0].encode(), bad, good[2].encode()]) + b'\n')
        with pytest.raises(Stop, match=f'{path} line 2 '):
            runfolder.read_metrics(str(path))
        warnings = []
        assert [r['iter'] for r in runfolder.read_metrics(str(path), warn=warnings.append)] == [0, 2]
        assert len(warnings) == 1 and f'{path} line 2' in warnings[0]


# ----------------------------------------------------------------------------- data

def decode(ids, meta):
    """Token ids back to text: id 0 (unknown) as U+FFFD, id i as meta['chars'][i - 1]."""
    chars = '\ufffd' + meta['chars']
    return ''.join(chars[i] for i in ids)


def test_encode_decode_round_trip_and_cache_reuse(tmp_path, text_file, tiny_config):
    """Encoding round-trips through decode; a second call reuses the cache untouched and writes nothing
    beside the source."""
    cfg = tiny_config(tmp_path, text_file)
    tr, va, meta = prepare.prepare_data(cfg)
    text = open(text_file, encoding='utf-8').read()
    cut = int(0.9 * len(text))
    assert decode(tr, meta) == text[:cut] and decode(va, meta) == text[cut:]
    folder = os.path.dirname(tr.filename)
    stamp = os.path.getmtime(os.path.join(folder, 'train.bin'))
    assert prepare.prepare_data(cfg)[2] == meta and os.path.getmtime(os.path.join(folder, 'train.bin')) == stamp
    assert os.listdir(os.path.dirname(text_file)) == ['corpus.txt']  # nothing written beside the source


def test_a_new_encoder_version_builds_a_new_cache(tmp_path, text_file, tiny_config, monkeypatch):
    """The cache key holds the encoder version: other encoding code never reuses a cache, and a run's
    config.json names the key, the vocabulary size and the number of encoded characters."""
    cfg = tiny_config(tmp_path, text_file)
    first = prepare.prepare_data(cfg)[2]
    monkeypatch.setattr(prepare, 'ENCODER_VERSION', prepare.ENCODER_VERSION + 1)
    second = prepare.prepare_data(cfg)[2]
    assert first['cache_key'] != second['cache_key'] and second['encoder_version'] == prepare.ENCODER_VERSION
    root = prepare.cache_root(cfg)
    assert {first['cache_key'], second['cache_key']} <= set(os.listdir(root))
    monkeypatch.undo()
    run_dir = train.train(tiny_config(tmp_path, text_file, '--max_iters=2'))
    saved = json.load(open(os.path.join(run_dir, 'config.json')))
    assert saved['data_cache'] == first['cache_key'] and saved['vocab_size'] == first['vocab_size']
    assert saved['n_chars'] == first['n_train'] + first['n_val'] == len(open(text_file, newline='').read())


def test_rare_characters_map_to_unknown(tmp_path):
    """Characters rarer than min_char_count in the training part share the unknown id 0."""
    path = tmp_path / 'rare.txt'
    path.write_text('ab' * 500 + 'é' + 'ab' * 100 + 'é' + 'ab' * 10, encoding='utf-8')
    cfg = train.get_config([f'--data_file={path}', f'--cache_dir={tmp_path / "c"}', '--min_char_count=2',
                            '--block_size=8'])
    tr, va, meta = prepare.prepare_data(cfg)
    assert meta['chars'] == 'ab' and meta['vocab_size'] == 3  # 'é' occurs once in train: unknown (id 0)
    assert (np.asarray(tr) == 0).sum() == 1 and meta['n_unknown_train'] == 1


@pytest.mark.parametrize('dataset, files', [('wikitext103', ['wiki.train.raw', 'wiki.valid.raw']),
                                            ('wikitext103-test', ['wiki.test.raw'])])
def test_missing_dataset_offline_says_what_to_do(tmp_path, dataset, files):
    """Without the dataset and without network, the error names each file to put where, or --data_file."""
    # port 9 on localhost refuses at once: the same path as having no network
    cfg = train.get_config([f'--data_dir={tmp_path / "data" / "wt"}', '--data_url=http://127.0.0.1:9/wt.zip',
                            f'--cache_dir={tmp_path / "c"}', f'--dataset={dataset}'])
    with pytest.raises(Stop) as info:
        prepare.prepare_data(cfg)
    msg = info.value.msg
    assert 'downloading http://127.0.0.1:9/wt.zip failed' in msg and '--data_file=PATH' in msg and 'shared' not in msg
    assert all(f'{tmp_path / "data" / "wt" / name}' in msg for name in files)
    assert f'Put {" and ".join(files)} from' in msg
    assert not os.path.exists(tmp_path / 'data')   # the folders made for the download go with it


def test_wikitext103_test_is_wiki_test_raw_split_as_a_data_file(tmp_path, synthetic_text, tiny_config, records,
                                                                 without_wall_clock):
    """--dataset=wikitext103-test reads data_dir/wiki.test.raw alone, split 90/10 as --data_file splits a file:
    the same cache, the same ids, the same numbers."""
    wt = tmp_path / 'wt'
    wt.mkdir()
    (wt / 'wiki.test.raw').write_text(synthetic_text(40_000, seed=3), encoding='utf-8')
    by_file = tiny_config(tmp_path, str(wt / 'wiki.test.raw'), '--run_name=file', '--max_iters=4')
    by_name = tiny_config(tmp_path, '', '--run_name=name', '--max_iters=4', '--dataset=wikitext103-test',
                          f'--data_dir={wt}', '--data_url=http://127.0.0.1:9/none.zip')  # nothing to download
    (tr, va, meta), (tr2, va2, meta2) = prepare.prepare_data(by_file), prepare.prepare_data(by_name)
    assert meta2 == meta and np.array_equal(tr, tr2) and np.array_equal(va, va2)
    assert without_wall_clock(records(train.train(by_name))) == without_wall_clock(records(train.train(by_file)))
    assert os.listdir(wt) == ['wiki.test.raw']


@pytest.mark.parametrize('kind', ['directory', '/dev/null', 'fifo'])
def test_a_data_file_that_is_not_a_regular_file_says_what_it_is(tmp_path, kind):
    """A directory, a device or a FIFO as --data_file is named as what it is, not 'does not exist'."""
    path = {'directory': str(tmp_path), '/dev/null': '/dev/null', 'fifo': str(tmp_path / 'fifo')}[kind]
    if kind == 'fifo':
        os.mkfifo(path)
    words = 'is a directory' if kind == 'directory' else 'is not a regular file (a device, a FIFO or a socket)'
    with pytest.raises(Stop, match=f'data_file {path} {re.escape(words)}'):
        prepare.prepare_data(train.get_config([f'--data_file={path}', f'--cache_dir={tmp_path / "c"}']))


def test_a_text_whose_every_character_is_rare_is_refused(tmp_path):
    """Every character rarer than min_char_count would leave the unknown id alone (vocab_size 1, loss 0)."""
    path = tmp_path / 'rare.txt'
    path.write_text(''.join(map(chr, range(0x4e00, 0x4e00 + 3000))), encoding='utf-8')
    with pytest.raises(Stop, match='every character of the training text occurs fewer than min_char_count=10'):
        prepare.prepare_data(train.get_config([f'--data_file={path}', f'--cache_dir={tmp_path / "c"}',
                                               '--block_size=8']))
    assert [n for n in os.listdir(tmp_path / 'c') if not n.startswith('.')] == []  # no cache of it


def test_corrupt_cache_is_named(tmp_path, text_file, tiny_config):
    """A cache file of the wrong length is named, with the fix."""
    cfg = tiny_config(tmp_path, text_file)
    tr, _, _ = prepare.prepare_data(cfg)
    folder = os.path.dirname(tr.filename)
    with open(os.path.join(folder, 'val.bin'), 'ab') as f:
        f.write(b'xx')
    with pytest.raises(SystemExit, match='corrupt or was built from a different file; delete'):
        prepare.prepare_data(cfg)


def test_text_shorter_than_a_block_is_refused(tmp_path):
    """A text too short for block_size is refused with the numbers."""
    path = tmp_path / 'short.txt'
    path.write_text('hello world ' * 10)
    with pytest.raises(SystemExit, match='too short for block_size'):
        prepare.prepare_data(train.get_config([f'--data_file={path}', '--block_size=64',
                                             f'--cache_dir={tmp_path / "c"}']))


@pytest.mark.parametrize('text', ['', 'a'])
def test_empty_or_tiny_text_says_it_is_too_short(tmp_path, text):
    """An empty text is too short, not a corrupt cache (whose advice looped)."""
    path = tmp_path / 'empty.txt'
    path.write_text(text)
    with pytest.raises(Stop, match='too short'):
        prepare.prepare_data(train.get_config([f'--data_file={path}', f'--cache_dir={tmp_path / "c"}']))


def test_invalid_utf8_text_is_named_and_leaves_no_building_folder(tmp_path, synthetic_text):
    """A text that is not UTF-8 is named with the offset of the first bad byte, and the
    half-built cache folder is removed."""
    path = tmp_path / 'latin1.txt'
    path.write_bytes(synthetic_text(5000).encode() + b'caf\xe9 ' + synthetic_text(5000).encode())
    with pytest.raises(Stop, match=f'{path} is not UTF-8 text .*byte 5003'):
        prepare.prepare_data(train.get_config([f'--data_file={path}', f'--cache_dir={tmp_path / "c"}']))
    assert [n for n in os.listdir(tmp_path / 'c') if n.startswith('.building')] == []


def test_stale_building_folders_are_removed_at_the_next_start(tmp_path, text_file, tiny_config):
    """A .building-* folder of a dead process on this host is removed; a live process's is kept."""
    import socket
    cache = tmp_path / 'cache'
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    stale = cache / f'.building-{socket.gethostname()}-{int(dead.stdout)}-abc'
    live = cache / f'.building-{socket.gethostname()}-{os.getpid()}-def'
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / 'train.bin').write_bytes(b'x' * 100)
    prepare.prepare_data(tiny_config(tmp_path, text_file))
    assert not stale.exists() and live.exists()


def test_same_length_garbage_in_the_cache_is_caught_by_its_checksum(tmp_path, text_file, tiny_config):
    """Meta.json holds checksums of train.bin and val.bin, checked when the cache is opened."""
    cfg = tiny_config(tmp_path, text_file)
    tr, _, meta = prepare.prepare_data(cfg)
    assert len(meta['train_sha256']) == 64 and len(meta['val_sha256']) == 64
    path = tr.filename
    size = os.path.getsize(path)
    with open(path, 'r+b') as f:
        f.seek(size // 2)
        f.write(b'\xff\xff' * 8)
    assert os.path.getsize(path) == size
    with pytest.raises(Stop, match='train.bin.*checksum.*delete'):
        prepare.prepare_data(cfg)


def test_an_unchanged_text_and_cache_are_not_hashed_again(tmp_path, text_file, tiny_config, monkeypatch):
    """The source text and the cache are hashed once; a later start checks their size and mtime."""
    cfg = tiny_config(tmp_path, text_file)
    prepare.prepare_data(cfg)
    hashed = []
    sha = prepare.sha256_of
    monkeypatch.setattr(prepare, 'sha256_of', lambda paths: hashed.append(list(paths)) or sha(paths))
    prepare.prepare_data(cfg)
    assert hashed == []
    os.utime(text_file, ns=(1, 1))  # the text may have changed: hash it again
    prepare.prepare_data(cfg)
    assert hashed == [[text_file]]


# ----------------------------------------------------------------------------- model

@pytest.mark.parametrize('name', sorted(train.QK_INITS))
def test_qk_inits(name):
    """The three Q/K inits: tied copies W_Q into W_K, orthogonal has full PR at the normal init's Frobenius norm."""
    torch.manual_seed(0)
    C, n_head = 64, 4
    model = train.GPT(train.GPTConfig(vocab_size=10, block_size=8, n_layer=2, n_head=n_head, n_embd=C), name)
    for wq, wk in model.qk_weights():
        g = geometry.layer_geometry(wq, wk, n_head)
        if name == 'tied':
            assert torch.equal(wq, wk) and g['pr_q'] == g['pr_k']
        elif name == 'orthogonal':
            assert g['pr_q'] == pytest.approx(C, rel=1e-9) and g['pr_k'] == pytest.approx(C, rel=1e-9)
            # same expected Frobenius norm as the normal init: only the spectrum's shape differs
            assert wq.norm().item() == pytest.approx(0.02 * C, rel=1e-5)
        else:
            assert not torch.equal(wq, wk) and g['pr_q'] < 0.6 * C


def test_probe_attention_matches_the_fused_kernel():
    """The explicit measuring attention gives the fused kernel's output, with causal rows that sum to 1."""
    torch.manual_seed(0)
    model = train.GPT(train.GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    x = torch.randint(20, (3, 16))
    probe = []
    assert torch.allclose(model(x)[0], model(x, probe=probe)[0], atol=1e-5)
    q, k, att = probe[0]
    assert q.shape == (3, 16, 16) and att.shape == (3, 2, 16, 16)
    assert torch.allclose(att.sum(-1), torch.ones(3, 2, 16)) and (att.triu(1) == 0).all()


def test_log_schedule_is_log_spaced_early():
    """Records are log-spaced early, every geom_interval later, and include every model checkpoint."""
    cfg = train.get_config(['--max_iters=1000', '--eval_interval=250', '--geom_interval=100', '--model_ckpts=5'])
    its = sorted(train.log_iters(cfg))
    assert {0, 1, 2, 4, 8, 16, 32, 64, 100, 250, 900} <= set(its) and its[-1] == 1000 and 128 not in its
    # model checkpoints (contract 5): 0, then 4 log-spaced from the end of warm-up (100) to max_iters
    assert train.model_ckpt_iters(cfg) == {0, 100, 215, 464, 1000} and train.model_ckpt_iters(cfg) <= set(its)
    for extra, want in ((['--warmup_iters=0'], {0, 1, 10, 100, 1000}), (['--model_ckpts=2'], {0, 1000}),
                        (['--model_ckpts=1'], {0}), (['--model_ckpts=0'], set())):
        assert train.model_ckpt_iters(train.get_config(['--max_iters=1000', '--model_ckpts=5', *extra])) == want


# ----------------------------------------------------------------------------- runs

def test_tiny_run_writes_every_file_and_snapshots_reproduce_the_log(tmp_path, text_file, tiny_config, records):
    """A tiny run writes every file; every logged weight metric is recomputed from its snapshot to 1e-6; a
    finished run is not overwritten by accident."""
    run_dir = train.train(tiny_config(tmp_path, text_file))
    for name in ('config.json', 'metrics.jsonl', 'ckpt.pt', 'done.json'):
        assert os.path.isfile(os.path.join(run_dir, name)), name
    rows = records(run_dir)
    assert [r['iter'] for r in rows] == [0, 1, 2, 4, 6, 8, 16]
    assert sorted(os.listdir(os.path.join(run_dir, 'models'))) == [   # 0, then 2 (warm-up's end) .. 16
        'model_0000000.pt', 'model_0000002.pt', 'model_0000006.pt', 'model_0000016.pt']
    assert len(os.listdir(os.path.join(run_dir, 'snapshots'))) == len(rows)
    cfg = json.load(open(os.path.join(run_dir, 'config.json')))
    assert cfg['n_layer'] == 2 and cfg['torch'] == torch.__version__ and cfg['device'] == 'cpu'
    done = json.load(open(os.path.join(run_dir, 'done.json')))
    assert done['iter'] == 16 and done['val_loss'] == rows[-1]['val_loss']
    assert done['control_share'] == 0 and 0 < done['geometry_share'] < 1   # no control ran
    snap0 = np.load(os.path.join(run_dir, 'snapshots', 'qk_0000000.npz'))  # W(0)
    ckpt = torch.load(os.path.join(run_dir, 'ckpt.pt'), weights_only=True)
    assert all(np.array_equal(w.numpy(), snap0[s][i]) for i, pair in enumerate(ckpt['w0']) for w, s in zip(pair, 'qk'))
    for row in rows:
        snap = np.load(os.path.join(run_dir, 'snapshots', f"qk_{row['iter']:07d}.npz"))
        assert snap['q'].dtype == np.float32 and snap['q'].shape == (2, 32, 32)
        for layer, logged in enumerate(row['layers']):
            again = geometry.layer_geometry(snap['q'][layer], snap['k'][layer], int(snap['n_head']))
            learned = geometry.learned_geometry(snap['q'][layer], snap['k'][layer], snap0['q'][layer],
                                                snap0['k'][layer], int(snap['n_head']))
            assert set(learned) == {'pr_dq', 'pr_dk', 'pr_dq_head', 'pr_dk_head', 'pr_dq_heads', 'pr_dk_heads',
                                    'dq_rel', 'dk_rel'}
            for key, value in {**again, **learned}.items():
                assert np.allclose(logged[key], value, rtol=1e-6, atol=0), (row['iter'], layer, key)
            assert (logged['dq_rel'] == 0) == (row['iter'] == 0) and (logged['dk_rel'] > 0) == (row['iter'] > 0)
            for key in ('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'entropy', 'entropy_norm'):
                assert np.isfinite(logged[key])
    # a finished run is not overwritten by accident
    with pytest.raises(SystemExit, match='finished run; pass --overwrite=True'):
        train.train(tiny_config(tmp_path, text_file))


def test_run_folder_must_lie_inside_out_dir(tmp_path, text_file, tiny_config):
    """A run folder that is a symlink out of out_dir is refused, and nothing there is touched."""
    outside = tmp_path / 'elsewhere'
    outside.mkdir()
    (outside / 'metrics.jsonl').write_text('{"iter": 0}\n')
    (tmp_path / 'out').mkdir()
    os.symlink(outside, tmp_path / 'out' / 'link')
    with pytest.raises(Stop, match='outside out_dir'):
        train.train(tiny_config(tmp_path, text_file, '--run_name=link'))
    assert os.listdir(outside) == ['metrics.jsonl']


def test_start_over_deletes_only_what_train_py_wrote(tmp_path, text_file, tiny_config):
    """A folder train.py did not make (no config.json of its own) is refused, not cleared; in
    its own folder, starting over removes its own files and keeps a user's."""
    foreign = tmp_path / 'out' / 'mine'
    (foreign / 'snapshots').mkdir(parents=True)
    for name in ('metrics.jsonl', 'snapshots/qk_0000000.npz', 'notes.txt'):
        (foreign / name).write_text('precious')
    with pytest.raises(Stop, match='not written by train.py'):
        train.train(tiny_config(tmp_path, text_file, '--run_name=mine', '--overwrite=True'))
    assert (foreign / 'metrics.jsonl').read_text() == 'precious'
    run_dir = train.train(tiny_config(tmp_path, text_file, '--run_name=own', '--max_iters=2'))
    for name in ('notes.txt', 'snapshots/notes.txt', 'models/README'):
        with open(os.path.join(run_dir, name), 'w') as f:
            f.write('precious')
    train.train(tiny_config(tmp_path, text_file, '--run_name=own', '--max_iters=2', '--overwrite=True'))
    for name in ('notes.txt', 'snapshots/notes.txt', 'models/README'):
        assert open(os.path.join(run_dir, name)).read() == 'precious'
    assert os.path.exists(os.path.join(run_dir, 'done.json'))


def test_config_json_holds_the_resolved_dtype(tmp_path, text_file, tiny_config):
    """Dtype=auto is written as what it resolved to (float32 on a CPU)."""
    run_dir = train.train(tiny_config(tmp_path, text_file, '--max_iters=1', '--geom_interval=0'))
    assert json.load(open(os.path.join(run_dir, 'config.json')))['dtype'] == 'float32'


def test_same_config_and_seed_give_identical_metrics(tmp_path, text_file, tiny_config, records, without_wall_clock):
    """Same config and seed: identical metrics; another seed: different metrics, measured on the same
    evaluation windows."""
    a = train.train(tiny_config(tmp_path, text_file, '--run_name=a'))
    b = train.train(tiny_config(tmp_path, text_file, '--run_name=b'))
    c = train.train(tiny_config(tmp_path, text_file, '--run_name=c', '--seed=2'))
    assert without_wall_clock(records(a)) == without_wall_clock(records(b))
    assert without_wall_clock(records(a)) != without_wall_clock(records(c))
    # the evaluation windows do not depend on the seed: eval_batch is the same whatever the seed and the
    # global RNG state, and each run's logged step-0 eval_loss is its step-0 model's loss on that batch
    cfg_a, cfg_c = (tiny_config(tmp_path, text_file, f'--seed={s}') for s in (1, 2))
    _, val, meta = prepare.prepare_data(cfg_a)
    batches = []
    for cfg in (cfg_a, cfg_c):
        torch.manual_seed(cfg['seed'])
        batches.append(train.eval_batch(val, cfg))
    assert all(torch.equal(u, v) for u, v in zip(*batches))
    for run_dir, cfg in ((a, cfg_a), (c, cfg_c)):
        saved = torch.load(os.path.join(run_dir, 'models', 'model_0000000.pt'), weights_only=True)
        model = train.GPT(train.GPTConfig(**saved['model_config']))
        model.load_state_dict(saved['model'])
        loss = model.eval()(*batches[0])[1].item()
        assert loss == pytest.approx(records(run_dir)[0]['eval_loss'], rel=1e-6)


def test_loss_falls_on_learnable_text(tmp_path, text_file, tiny_config, records):
    """The loss falls on learnable text; geom_interval=0 turns geometry logging off."""
    run_dir = train.train(tiny_config(tmp_path, text_file, '--max_iters=120', '--lr=3e-3', '--geom_interval=0',
                                      '--eval_interval=60', '--eval_iters=4'))
    rows = records(run_dir)
    assert 'layers' not in rows[0]  # geom_interval=0 switches geometry logging off
    assert rows[-1]['val_loss'] < 0.75 * rows[0]['val_loss'], [r['val_loss'] for r in rows]


def test_decay_qk_moves_wq_and_wk_out_of_the_weight_decay_group(tmp_path, text_file, tiny_config):
    """decay_qk=False moves W_Q and W_K of every layer to the group without weight decay."""
    groups = {}
    for flag in ('True', 'False'):
        run_dir = train.train(tiny_config(tmp_path, text_file, f'--decay_qk={flag}', f'--run_name={flag}',
                                          '--max_iters=1', '--geom_interval=0', '--model_ckpts=0'))
        ckpt = torch.load(os.path.join(run_dir, 'ckpt.pt'), weights_only=True)
        groups[flag] = [len(g['params']) for g in ckpt['optimizer']['param_groups']]
        assert [g['weight_decay'] for g in ckpt['optimizer']['param_groups']] == [0.1, 0.0]
    n_layer = 2
    assert groups['False'][0] == groups['True'][0] - 2 * n_layer
    assert groups['False'][1] == groups['True'][1] + 2 * n_layer


def test_no_host_reads_between_records(tmp_path, text_file, tiny_config, monkeypatch):
    """The training step leaves its loss and the stop flags on the device: train.py reads no float or bool
    tensor back to the host (Tensor.item, float(), bool(), tolist(), numpy()) in train_step, control_step or the
    loop; read_flags reads them once at each record or checkpoint iteration."""
    here = os.path.abspath(train.__file__)
    reads, flag_reads = [], []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)  # train.py's own reads (torch's optimizer reads its CPU step counts)
            if os.path.abspath(caller.f_code.co_filename) == here and (self.dtype.is_floating_point
                                                                        or self.dtype == torch.bool):
                frame, inside = caller, []
                while frame:
                    if os.path.abspath(frame.f_code.co_filename) == here:
                        inside.append(frame.f_code.co_name)
                    frame = frame.f_back
                if inside and (inside[0] == 'loop' or {'train_step', 'control_step'} & set(inside)):
                    reads.append((name, inside[0]))
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ('item', 'tolist', 'numpy', '__bool__', '__float__', '__int__'):
        counted(name)
    read_flags = train.read_flags
    monkeypatch.setattr(train, 'read_flags', lambda run, it: flag_reads.append(it) or read_flags(run, it))
    train.train(tiny_config(tmp_path, text_file, '--max_iters=40', '--eval_interval=20', '--geom_interval=0',
                            '--ckpt_interval=20', '--model_ckpts=0'))
    assert reads == []
    assert flag_reads == [0, 20, 40]  # 40 steps, 3 reads: the records at 0, 20, 40 (and the checkpoint at 20)


def test_the_eta_waits_for_a_settled_average(capsys):
    """The ETA is printed from the average of at least ETA_AFTER iterations, never from iteration 1 alone."""
    cfg = {'max_iters': 1000}
    now = __import__('time').time()
    for it, shown in ((1, False), (train.ETA_AFTER - 1, False), (train.ETA_AFTER, True), (500, True)):
        train.print_record({'iter': it, 'lr': 1e-3}, 10.0, 100, cfg, 0, now - 10)
        line = capsys.readouterr().out
        assert ('ETA -' not in line) == shown, line
