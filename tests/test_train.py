"""train.py and its helpers: settings, names, data, the run folder, exact resume after a kill,
DDP."""
import ast
import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from plumbing import configurator
import geometry
from plumbing import prepare
from plumbing import runfolder
import train
from conftest import REPO, make_text, records, run_train, tiny_args


def cfg_of(tmp_path, text_file, *extra):
    return train.get_config(tiny_args(tmp_path, text_file, *extra))


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """One uninterrupted tiny run, trained once for the tests that compare against it."""
    tmp = tmp_path_factory.mktemp('reference')
    text = tmp / 'text.txt'
    text.write_text(make_text(60_000))
    cfg = train.get_config(tiny_args(tmp, text))
    return text, train.train(cfg)


# ----------------------------------------------------------------------------- settings and names

def test_overrides_take_the_type_of_the_default_and_the_command_line_wins(tmp_path):
    (tmp_path / 'a.py').write_text('n_layer, n_head = 2, 2\nlr = 3\nseed = 5\n')
    (tmp_path / 'b.json').write_text('{"seed": 6, "decay_qk": false}')
    cfg = train.get_config(['--seed=2', str(tmp_path / 'a.py'), str(tmp_path / 'b.json'),
                            '--run_name=123'])
    settings = (cfg['n_layer'], cfg['n_head'], cfg['lr'], cfg['seed'], cfg['decay_qk'])
    assert settings == (2, 2, 3.0, 2, False)
    assert cfg['run_name'] == '123' and isinstance(cfg['lr'], float)
    (tmp_path / 'c.json').write_text('{"seed": 6,\n}')
    with pytest.raises(configurator.Stop,
                       match=f"config file {tmp_path / 'c.json'} line 2: Expecting property name"):
        train.get_config([str(tmp_path / 'c.json')])
    (tmp_path / 'list.json').write_text('[1, 2]')
    (tmp_path / 'latin.py').write_bytes(b'seed = 2  # caf\xe9\n')
    for name, words in (('list.json', 'expected a JSON object'),
                        ('latin.py', "'utf-8' codec can't decode byte 0xe9")):
        with pytest.raises(configurator.Stop, match=f"config file {tmp_path / name}: {words}"):
            train.get_config([str(tmp_path / name)])


@pytest.mark.parametrize('args, words', [
    (['--n_layers=4'], "unknown config key 'n_layers'; did you mean n_layer?"),
    (['--n_embd=64', '--n_head=5'],
     'n_embd=64: expected 1 <= n_embd <= 1e9 and n_embd % n_head == 0 (n_head=5)'),
    (['--seed'], '--seed needs a value'),
])
def test_a_plausible_mistake_is_one_line_naming_it(args, words):
    with pytest.raises(configurator.Stop,
                       match=words.replace('?', r'\?').replace('(', r'\(').replace(')', r'\)')):
        train.get_config(args)


def test_the_command_line_gives_one_line_and_exit_2(tmp_path):
    out = run_train(['--n_layers=4'])
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: unknown config key 'n_layers'; did you mean n_layer?"]
    out = run_train(['--device=cuda:99', f'--out_dir={tmp_path}'])
    assert (out.returncode == 2
            and 'error: --device=cuda:99 is not available here (available: cpu' in out.stderr)
    assert 'every setting: python train.py --help' in run_train(['--seed']).stderr


@pytest.mark.parametrize('flag', ['--help', '-h'])
def test_help_lists_every_setting_with_its_default_and_comment_under_its_header(flag):
    out = run_train([flag, '--n_layers=4'])
    assert out.returncode == 0 and out.stderr == '' and out.stdout.startswith(train.__doc__.strip())
    lines = out.stdout.split('settings: --key=value')[1].splitlines()
    rows = {line.split()[0]: line.split(None, 2) for line in lines if line.startswith('  ')}
    assert sorted(rows) == sorted(train.config_keys)
    for key, default, comment in rows.values():
        assert ast.literal_eval(default) == getattr(train, key) and comment, key
    assert rows['run_name'][1:] == [
        "''", "'' = from the settings: L4_normal_s1, then a hash of the rest"]
    # each header above its own settings, in the config block's order
    order = [line.split()[0] for line in lines if line in ('model', 'optimizer') or
             line.startswith(('  n_layer ', '  qk_init ', '  optimizer ', '  grad_clip '))]
    assert order == ['model', 'n_layer', 'qk_init', 'optimizer', 'optimizer', 'grad_clip']


def test_run_names_differ_in_every_setting_and_read_the_main_ones():
    name = lambda *a: train.get_config(list(a))['run_name']
    assert name() == 'L4_normal_s1'
    assert name('--control=shrink', '--shrink_to=0.2', '--seed=3') == 'L4_normal_shrink0.2-k_s3'
    assert name('--control=freeze', '--control_keep=spec') == 'L4_normal_freeze-k-spec_s1'
    assert name('--lr=3e-3').startswith('L4_normal_s1-') and name('--lr=3e-3') != name('--lr=1e-2')
    assert name('--device=cpu', '--threads=2', '--out_dir=x') == 'L4_normal_s1'   # where, not what


def test_a_text_by_another_path_or_a_link_is_the_same_run(tmp_path, text_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink(text_file, 'link.txt')
    cfgs = [train.get_config([f'--data_file={path}'])
            for path in (text_file, 'text.txt', './link.txt')]
    # as sweep.sh reads
    settings = [{k: v for k, v in c.items() if k not in configurator.NOT_IN_NAME} for c in cfgs]
    assert settings[0] == settings[1] == settings[2] and len({c['run_name'] for c in cfgs}) == 1
    (tmp_path / 'other.txt').write_text(make_text(60_000, seed=1))
    assert train.get_config(['--data_file=other.txt'])['run_name'] != cfgs[0]['run_name']


def test_a_forker_s_new_config_key_trains_under_its_own_name(tmp_path, text_file):
    fork = tmp_path / 'fork'
    shutil.copytree(os.path.join(REPO, 'plumbing'), fork / 'plumbing')
    for f in os.listdir(REPO):
        if f.endswith('.py'):
            shutil.copy(os.path.join(REPO, f), fork)
    src = (fork / 'train.py').read_text()
    (fork / 'train.py').write_text(src.replace("dropout = 0.0 ",
                                               "rope = False               # a forker's key\n"
                                               "dropout = 0.0 ", 1))
    args = tiny_args(tmp_path, text_file, '--max_iters=4', '--geom_interval=0', '--model_ckpts=0')
    for extra in ([], ['--rope=True']):
        out = run_train(args + extra, cwd=fork, script=fork / 'train.py')
        assert out.returncode == 0, out.stderr
    names = sorted(os.listdir(tmp_path / 'out'))
    assert len(names) == 2 and names[0] == 'L2_normal_s1-' + names[0].split('-')[1]
    # a number not in SETTINGS
    with pytest.raises(configurator.Stop, match='rope_base=inf: expected a finite number'):
        configurator.check(dict(train.get_config([]), rope_base=float('inf')), train.SETTINGS,
                           vars(train))


# ----------------------------------------------------------------------------- data

def test_the_cache_is_keyed_by_the_text_and_the_encoder_version(tmp_path, text_file, monkeypatch):
    cfg = cfg_of(tmp_path, text_file)
    train_data, val_data, meta = prepare.prepare_data(cfg)
    text = text_file.read_text()
    assert len(train_data) == int(0.9 * len(text)) and len(val_data) == len(text) - len(train_data)
    decode = dict(enumerate(meta['chars'], 1))
    assert ''.join(decode[i] for i in val_data[:50]) == text[len(train_data):len(train_data) + 50]
    assert meta['cache_key'].startswith(f"text.txt-{meta['sha256'][:16]}-min1-enc")
    text_file.write_text(text.replace('the', 'The'))
    assert prepare.prepare_data(cfg)[2]['cache_key'] != meta['cache_key']
    monkeypatch.setattr(prepare, 'ENCODER_VERSION', 99)
    built = tmp_path / 'cache' / prepare.prepare_data(cfg)[2]['cache_key']
    assert built.name.endswith('-enc99')
    # a DDP rank that finishes second: the first build stays
    prepare.build(str(built), 'text.txt', lambda tmp: None)
    assert (built / 'meta.json').exists() and not [n for n in os.listdir(built.parent)
                                                   if n.startswith('.building')]


@pytest.mark.parametrize('download', ['missing', 'not a zip'])
def test_a_failed_download_names_the_file_and_data_file_and_makes_no_folder(tmp_path, download):
    (tmp_path / 'page.zip').write_text('<html>not found</html>')
    served = 'no.zip' if download == 'missing' else 'page.zip'
    cfg = train.get_config(['--dataset=wikitext103-test', f'--data_dir={tmp_path / "data" / "raw"}',
                            f'--data_url=file://{tmp_path}/{served}'])
    with pytest.raises(configurator.Stop,
                       match=r'downloading failed .*put wiki\.test\.raw .* --data_file=PATH'):
        prepare.prepare_data(cfg)
    assert sorted(os.listdir(tmp_path)) == ['page.zip']


def test_a_text_that_is_not_utf8_or_has_too_many_characters_is_one_line(tmp_path, text_file):
    # the stray byte at offset 33
    text_file.write_bytes(b'plain ascii \xc3\xa9 then a stray byte \xff and more')
    with pytest.raises(configurator.Stop,
                       match=r'text.txt is not UTF-8: byte 33 \(invalid start byte\)'):
        prepare.prepare_data(cfg_of(tmp_path, text_file))
    # 72,000 training characters
    text_file.write_text(''.join(map(chr, range(0x10000, 0x10000 + 80_000))))
    with pytest.raises(configurator.Stop,
                       match='72000 characters occur at least min_char_count=1 times, more than '
                                                'uint16 ids hold'):
        prepare.prepare_data(cfg_of(tmp_path, text_file))


def test_the_evaluation_batch_is_free_of_the_seed_and_the_global_rng_and_pinned_on_a_gpu(
        tmp_path, text_file, monkeypatch):
    _, val, _ = prepare.prepare_data(cfg_of(tmp_path, text_file))
    x1, _ = train.eval_batch(val, cfg_of(tmp_path, text_file, '--seed=1'))
    torch.manual_seed(7)
    torch.rand(100)
    assert torch.equal(x1, train.eval_batch(val, cfg_of(tmp_path, text_file, '--seed=2'))[0])
    pinned = []
    monkeypatch.setattr(torch.Tensor, 'pin_memory', lambda t: pinned.append(tuple(t.shape)) or t)
    for pin in (False, True):
        x, y = train.get_batch(np.arange(100, dtype=np.uint16), torch.tensor([0, 5]), 8, pin)
    assert pinned == [(2, 8), (2, 8)] and (y - x == 1).all()


# ---------------------------------------------------------------------- the model and the optimizer

@pytest.mark.parametrize('name', sorted(train.QK_INITS))
def test_qk_inits(name):
    torch.manual_seed(0)
    model = train.GPT(train.GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=64),
                      name)
    wq, wk = model.qk_weights()[0]
    assert abs(wq.norm().item() / (0.02 * 64) - 1) < 0.1
    assert torch.equal(wq, wk) == (name == 'tied')
    assert (geometry.matrix_pr(wq) > 63) == (name == 'orthogonal')


def test_probe_attention_matches_the_fused_kernel():
    torch.manual_seed(0)
    model = train.GPT(train.GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2,
                                      n_embd=32)).eval()
    x = torch.randint(20, (3, 16))
    probe = []
    assert torch.allclose(model(x)[0], model(x, probe=probe)[0], atol=1e-5) and len(probe) == 2


@pytest.mark.parametrize('optimizer', ['adamw', 'sgd'])
def test_both_optimizers_decay_the_same_matrices(optimizer):
    model = train.GPT(train.GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16))
    qk = {id(w) for pair in model.qk_weights() for w in pair}
    for decay_qk in (True, False):
        cfg = train.get_config([f'--optimizer={optimizer}', f'--decay_qk={decay_qk}',
                                '--momentum=0.5'])
        opt = train.make_optimizer(model, cfg, 'cpu')
        decayed = {id(p) for g in opt.param_groups if g['weight_decay'] for p in g['params']}
        assert qk <= decayed if decay_qk else not qk & decayed
        matrices = sum(p.dim() >= 2 for p in model.parameters())
        assert len(decayed) == matrices - (0 if decay_qk else len(qk))
        assert type(opt).__name__ == {'adamw': 'AdamW', 'sgd': 'SGD'}[optimizer]
        assert optimizer == 'adamw' or opt.param_groups[0]['momentum'] == 0.5


# ----------------------------------------------------------------------------- a run and its folder

def test_a_run_writes_its_folder_and_the_snapshots_give_the_logged_weight_metrics(reference):
    _, run_dir = reference
    assert sorted(os.listdir(run_dir)) == ['ckpt.pt', 'config.json', 'done.json', 'metrics.jsonl',
                                           'models', 'snapshots']
    cfg = json.load(open(os.path.join(run_dir, 'config.json')))
    assert cfg['dtype'] == 'float32' and len(cfg['data_sha256']) == 64 and cfg['vocab_size'] > 20
    rows = records(run_dir)
    assert [r['iter'] for r in rows] == [0, 1, 2, 4, 6, 8, 16] and 'val_loss' in rows[-1]
    w0 = np.load(os.path.join(run_dir, 'snapshots', 'qk_0000000.npz'))
    for r in rows:
        snap = np.load(f"{run_dir}/snapshots/qk_{r['iter']:07d}.npz")
        for layer, logged in enumerate(r['layers']):
            again = {**geometry.layer_geometry(snap['q'][layer], snap['k'][layer], 2),
                     **geometry.learned_geometry(snap['q'][layer], snap['k'][layer], w0['q'][layer],
                                                 w0['k'][layer], 2)}
            assert {k: logged[k] for k in again} == runfolder.logged(again)
    models = sorted(os.listdir(os.path.join(run_dir, 'models')))
    assert models == [f'model_{i:07d}.pt' for i in (0, 2, 6, 16)]
    assert rows[-1]['val_loss'] < rows[0]['val_loss'] - 0.2
    done = json.load(open(os.path.join(run_dir, 'done.json')))
    assert done['val_loss'] == rows[-1]['val_loss'] and 0 < done['geometry_share'] < 1


def test_a_finished_run_is_kept_and_overwrite_deletes_only_what_train_py_wrote(tmp_path, text_file):
    cfg = cfg_of(tmp_path, text_file, '--max_iters=4')
    run_dir = train.train(cfg)
    with pytest.raises(configurator.Stop, match='holds a finished run; pass --overwrite=True'):
        train.train(cfg)
    (tmp_path / 'out' / cfg['run_name'] / 'notes.txt').write_text('mine')
    (tmp_path / 'out' / cfg['run_name'] / 'snapshots' / 'mine.npz').write_text('mine')
    train.train(dict(cfg, overwrite=True))
    assert (tmp_path / 'out' / cfg['run_name'] / 'notes.txt').read_text() == 'mine'
    assert (tmp_path / 'out' / cfg['run_name'] / 'snapshots' / 'mine.npz').exists()
    foreign = tmp_path / 'out' / 'foreign'
    foreign.mkdir()
    (foreign / 'ckpt.pt').write_text('not ours')
    with pytest.raises(configurator.Stop, match='not written by train.py'):
        train.train(dict(cfg, run_name='foreign', overwrite=True))
    assert (foreign / 'ckpt.pt').read_text() == 'not ours' and os.path.exists(run_dir)


def test_the_first_lines_say_the_sizes_and_a_time_estimate_before_the_first_loss_estimate(
        tmp_path, text_file, monkeypatch, capsys):
    estimate_loss = train.estimate_loss

    def said(*args):
        print('estimating the loss')
        return estimate_loss(*args)
    monkeypatch.setattr(train, 'estimate_loss', said)
    run_dir = train.train(cfg_of(tmp_path, text_file, '--max_iters=4'))
    lines = capsys.readouterr().out.splitlines()
    n_params = json.load(open(os.path.join(run_dir, 'config.json')))['n_params']
    first = lines.index(f'cpu: {n_params / 1e6:.2f}M parameters, 256 tokens an iteration '
                        '(batch_size x grad_accum x block_size), 4 iterations')
    assert re.fullmatch(r'about \d+s to go on cpu, evaluations aside \(from the first '
                        r'micro-batch\)', lines[first + 1])
    assert lines[first + 2] == 'estimating the loss' and lines[first + 4].startswith('iter 0: ')


def test_overwrite_deletes_the_old_run_once_the_new_one_has_its_optimizer_state_and_first_record(
        tmp_path, text_file, monkeypatch):
    cfg = cfg_of(tmp_path, text_file, '--max_iters=4')
    run_dir = pathlib.Path(train.train(cfg))
    files = lambda: {p: p.read_bytes() for p in run_dir.rglob('*') if p.is_file()}
    before = files()

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")
    for owner, name in ((torch.optim.AdamW, 'step'), (train, 'estimate_loss'),
                        (geometry, 'record')):
        with monkeypatch.context() as m:
            m.setattr(owner, name, no_memory)
            with pytest.raises(configurator.Stop, match='do not fit on cpu'):
                train.train(dict(cfg, overwrite=True))
        assert files() == before, name


def test_a_read_only_run_folder_or_a_damaged_checkpoint_is_one_line_naming_the_fix(
        tmp_path, text_file, monkeypatch, capsys):
    args = tiny_args(tmp_path, text_file, '--max_iters=4', '--run_name=r')
    run_dir = pathlib.Path(train.train(train.get_config(args)))
    (run_dir / 'done.json').unlink()   # unfinished: the same command resumes it
    files = lambda: {p: p.read_bytes() for p in run_dir.rglob('*') if p.is_file()}
    before, access = files(), os.access

    def refused(args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            train.main(args)
        assert stop.value.code == 2 and files() == before
        return capsys.readouterr().err.strip().splitlines()
    with monkeypatch.context() as m:   # read-only for root too, as a read-only file system is
        m.setattr(os, 'access', lambda path, mode: mode != os.W_OK and access(path, mode)
                  if os.path.realpath(path) == str(run_dir.resolve()) else access(path, mode))
        assert refused(args) == [f'error: cannot write in the run folder {run_dir}: Permission '
                                 'denied; make it writable, or another --out_dir']
    torch.save(torch.zeros(3), tmp_path / 'tensor.pt')
    ckpt, words = before[run_dir / 'ckpt.pt'], (
        f'error: {re.escape(str(run_dir))}/ckpt.pt is damaged or not a checkpoint of train.py '
        r'\(\w+\): remove it, or pass --overwrite=True to start the run over')
    for damaged in (ckpt[:len(ckpt) // 2], b'garbage', b'', (tmp_path / 'tensor.pt').read_bytes()):
        (run_dir / 'ckpt.pt').write_bytes(damaged)
        before = files()
        said = refused(args)
        assert len(said) == 1 and re.fullmatch(words, said[0]), said
    train.main(args + ['--overwrite=True'])
    assert (run_dir / 'done.json').exists()


def mistakes(default):
    """A wrong type, a negative, zero, a huge value, NaN and infinity, as the default's type allows
    (and ',')."""
    if isinstance(default, str):
        return [1.5, '-1', '0', '9' * 300, 'nan', 'inf', ',']
    return ['abc', -1, 0, 10 ** 12 if type(default) is int else 1e30, float('nan'), float('inf')]


def test_every_mistake_in_every_setting_trains_or_is_one_line_and_a_finished_run_stays(
        tmp_path, monkeypatch):
    """Each value in a config file given to a finished run with overwrite: it trains, or it stops
    with one line naming the setting and the run's files as they were. A number that is of another
    type, negative, NaN or inf is refused."""
    monkeypatch.chdir(tmp_path)   # where a relative out_dir or cache_dir goes
    text, short, bad = tmp_path / 'text.txt', tmp_path / 'short.txt', tmp_path / 'bad.txt'
    text.write_text(make_text(20_000))
    short.write_text(make_text(300))
    bad.write_bytes(make_text(20_000).encode()[:-1] + b'\xff')
    cfg = train.get_config(tiny_args(tmp_path, text, '--n_layer=1', '--n_embd=8', '--max_iters=1',
                                     '--eval_interval=1',
                                     '--geom_interval=1', '--eval_iters=1', '--model_ckpts=1',
                                     '--run_name=done'))
    run_dir = pathlib.Path(train.train(cfg))
    base = {k: cfg[k] for k in train.config_keys} | {'overwrite': True}
    (tmp_path / 'base.json').write_text(json.dumps(base))
    shutil.copytree(run_dir, tmp_path / 'kept')
    files = lambda: {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob('*')
                     if p.is_file()}
    before, refused = files(), set()
    cases = [(k, v, k) for k in train.config_keys for v in mistakes(cfg[k])] + [
        ('n_embd', 400_000, 'n_embd'), ('data_file', str(short), 'block_size'),
        ('data_file', str(bad), 'UTF-8')]
    for key, value, word in cases:
        (tmp_path / 'case.json').write_text(json.dumps({key: value}))
        try:
            train.train(train.get_config([str(tmp_path / 'base.json'),
                                          str(tmp_path / 'case.json')]))
        except configurator.Stop as e:
            assert '\n' not in e.code and re.search(rf'\b{word}\b', e.code), (key, value, e.code)
            # else the run trained, until the loss or the weights were not finite
            if 'the run stops' not in e.code:
                assert files() == before, (key, value, e.code)
                refused.add((key, json.dumps(value)))
        shutil.rmtree(run_dir)
        shutil.copytree(tmp_path / 'kept', run_dir)
    numbers = [(k, json.dumps(v)) for k, v, _ in cases if not isinstance(cfg[k], str) and
               (isinstance(cfg[k], bool) or v not in (0, 10 ** 12, 1e30))]
    assert set(numbers) <= refused, sorted(set(numbers) - refused)
    # 256 TiB at the first batch
    monkeypatch.setattr(train.GPT, 'forward', lambda *a, **k: torch.empty(1 << 46))
    with pytest.raises(configurator.Stop, match=r'n_layer=1, n_embd=8, .* do not fit on cpu'):
        train.train(dict(cfg, overwrite=True))
    assert files() == before


def test_a_bad_run_folder_a_held_one_a_read_only_cache_a_full_disk_and_too_few_gpus_are_one_line(
        tmp_path, text_file, monkeypatch):
    (tmp_path / 'out').mkdir()
    (tmp_path / 'out' / 'file').write_text('mine')
    os.symlink(tmp_path / 'out' / 'nowhere', tmp_path / 'out' / 'dangling')
    os.symlink(tmp_path / 'out' / 'loop', tmp_path / 'out' / 'loop')
    os.symlink(tmp_path, tmp_path / 'out' / 'away')
    for arg in ('file', 'dangling', 'loop', 'away', '../x', 'a/b',
                f'x --out_dir={tmp_path / "out" / "file"}'):
        with pytest.raises(configurator.Stop,
                           match=r'run folder .*(\(out_dir, run_name\): |not a folder of out_dir)'):
            train.train(cfg_of(tmp_path, text_file, *f'--run_name={arg}'.split()))
    cfg = cfg_of(tmp_path, text_file, '--max_iters=8')
    _, lock = runfolder.claim(cfg, master=True)   # as another train.py would hold it
    with pytest.raises(configurator.Stop, match='another train.py is training in'):
        train.train(cfg)
    lock.close()
    prepare.prepare_data(cfg)
    os.chmod(tmp_path / 'cache', 0o555)
    save = runfolder.atomic_save

    # root ignores the chmod: no file of the cache is opened to write
    def read_only(path, mode='r', **kwargs):
        assert not set(mode) & set('wa+'), path
        return open(path, mode, **kwargs)

    def full_disk(obj, path, *how):
        if path.endswith('ckpt.pt') and obj['iter'] == 8:
            raise OSError(errno.ENOSPC, 'No space left on device', path)
        save(obj, path, *how)
    monkeypatch.setattr(prepare, 'open', read_only, raising=False)
    monkeypatch.setattr(runfolder, 'atomic_save', full_disk)
    with pytest.raises(configurator.Stop, match='no space left for .*ckpt.pt: free some; the same '
                                                'command resumes from iteration 4'):
        train.train(dict(cfg, ckpt_interval=4))
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(os, 'environ',
                        dict(os.environ, RANK='1', LOCAL_RANK='1', WORLD_SIZE='2',
                             LOCAL_WORLD_SIZE='2'))
    with pytest.raises(configurator.Stop,
                       match='torchrun started 2 processes on a machine with 1 GPUs: use '
                                                '--nproc_per_node=1'):
        runfolder.start('')


def test_a_step_s_random_streams_follow_seed_rank_and_iteration_alone(monkeypatch):
    """Mocked CUDA: a step's draws do not depend on earlier ones (a resume is exact on any number of
    GPUs), DDP ranks draw their own dropout masks and the same windows; --device=cuda:1 is the
    current device."""
    cuda, states, gen = [], {}, torch.Generator()
    monkeypatch.setattr(torch.cuda, 'manual_seed_all', cuda.append)

    def draws(rank, it):   # CUDA's seed, torch's draws, the windows' offsets
        runfolder.seed_all(1, rank, it, gen)
        return cuda[-1], torch.rand(2).tolist(), torch.randperm(9, generator=gen).tolist()
    first = draws(0, 8)
    torch.rand(100), torch.rand(9, generator=gen)   # earlier draws
    assert draws(0, 8) == first and draws(0, 9)[-1] != first[-1]
    assert all(a != b for a, b in zip(draws(1, 8)[:-1], first)) and draws(1, 8)[-1] == first[-1]
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    monkeypatch.setattr(torch.cuda, 'set_device', lambda dev: states.update(current=dev))
    assert runfolder.start('cuda:1') == (False, 0, 1, 'cuda:1') and states['current'] == 'cuda:1'


# ----------------------------------------------------------------------------- kills, resume, NaN

KILLER = r'''
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import train
from plumbing import runfolder
point, at = sys.argv[2], int(sys.argv[3])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
record, save, get_lr, finish = train.record, runfolder.atomic_save, train.get_lr, train.finish

def killing_record(run, it):
    record(run, it)
    if it == at and point == 'record':
        die()
    if it == at and point in ('sigint', 'sigterm'):   # Ctrl-C, a Slurm time limit
        os.kill(os.getpid(), signal.SIGINT if point == 'sigint' else signal.SIGTERM)
        print('the line after the signal', file=sys.stderr, flush=True)
    if it == at and point == 'half_line':
        run.metrics.write('{"iter": 99, "train_lo')
        run.metrics.flush()
        die()

def killing_save(obj, path, *how):
    if point == 'ckpt' and path.endswith('ckpt.pt') and obj['iter'] == at:
        open(path + '.tmp', 'wb').write(b'half a checkpoint')
        die()
    save(obj, path, *how)

def finishing(run):   # a SIGTERM after the last record
    os.kill(os.getpid(), signal.SIGTERM)
    finish(run)

train.record, runfolder.atomic_save = killing_record, killing_save
if point == 'finish':
    train.finish = finishing
if point == 'nan':
    train.get_lr = lambda it, cfg: float('nan') if it >= at else get_lr(it, cfg)
train.main(sys.argv[4:])
'''


def run_killed(tmp_path, args, point, at):
    script = tmp_path / 'killer.py'
    script.write_text(KILLER)
    return subprocess.run([sys.executable, str(script), REPO, point, str(at), *args],
                          capture_output=True, text=True)


@pytest.mark.parametrize('point, at, control, again', [
    ('record', 4, 'none', []), ('record', 16, 'freeze', []), ('half_line', 16, 'none', []),
    ('ckpt', 8, 'shrink', []),
    # threads change round-off: the resumed run keeps its checkpoint's
    ('ckpt', 16, 'none', ['--threads=2']),
    ('sigint', 4, 'none', [])])   # Ctrl-C: a checkpoint at the next iteration, then one line
def test_a_kill_or_ctrl_c_at_any_point_then_the_same_command_gives_the_uninterrupted_records(
        tmp_path, reference, capsys, point, at, control, again):
    text, ref_dir = reference
    args = tiny_args(tmp_path, text, f'--control={control}', '--shrink_iters=8', '--run_name=r')
    killed = run_killed(tmp_path, args, point, at)
    assert killed.returncode == (1 if point == 'sigint' else -signal.SIGKILL)
    assert point != 'sigint' or killed.stderr.strip().splitlines() == [
        f"Ctrl-C: the run stops after this iteration, checkpointing to {tmp_path / 'out' / 'r'}"
        '/ckpt.pt (a second Ctrl-C stops it at once, without)', 'the line after the signal',
        'stopped at iteration 5: ckpt.pt holds it, and the same command resumes from there']
    # the same command, here in this process
    resumed = records(train.train(train.get_config(args + again)))
    out = capsys.readouterr().out
    expected = records(ref_dir) if control == 'none' else records(train.train(train.get_config(
        tiny_args(tmp_path / 'ref', text, f'--control={control}', '--shrink_iters=8'))))
    assert resumed == expected
    assert ('resuming' in out) == (at == 16 or point == 'sigint')
    assert 'to go on cpu, evaluations aside' in out and 'nan ms/iter' not in out
    assert ('resuming in float32 on 1 threads as ckpt.pt was trained' in out) == bool(again)


@pytest.mark.parametrize('point, at', [('sigterm', 4), ('finish', 16)])
def test_sigterm_is_said_at_once_and_leaves_a_checkpoint_or_a_finished_run(
        tmp_path, text_file, point, at):
    run_dir = tmp_path / 'out' / 'r'
    killed = run_killed(tmp_path, tiny_args(tmp_path, text_file, '--run_name=r'), point, at)
    said = killed.stderr.strip().splitlines()
    assert said[0] == (f'SIGTERM: the run stops after this iteration, checkpointing to {run_dir}'
                       '/ckpt.pt (a second SIGTERM stops it at once, without)')
    saved = torch.load(run_dir / 'ckpt.pt', weights_only=True)['iter']
    if point == 'sigterm':
        assert said[1:] == ['the line after the signal', 'stopped at iteration 5: ckpt.pt holds '
                            'it, and the same command resumes from there']
        assert killed.returncode == 1 and saved == 5 and not (run_dir / 'done.json').exists()
    else:
        assert killed.returncode == 0 and saved == 16 and (run_dir / 'done.json').exists()
        assert killed.stdout.strip().splitlines()[-1].startswith('done in ')


def test_a_checkpoint_resumes_only_with_its_own_settings_and_text_in_its_own_dtype(
        tmp_path, text_file, capsys):
    args = tiny_args(tmp_path, text_file, '--run_name=r')
    assert run_killed(tmp_path, args, 'record', 16).returncode == -signal.SIGKILL
    with pytest.raises(configurator.Stop, match=r'written with other settings \(lr\)'):
        train.train(train.get_config(args + ['--lr=0.01']))
    text = text_file.read_text()
    text_file.write_text(make_text(60_000, seed=1))
    with pytest.raises(configurator.Stop, match=r'other settings \(the training text\)'):
        train.train(train.get_config(args))
    text_file.write_text(text)
    path = tmp_path / 'out' / 'r' / 'ckpt.pt'
    ckpt = torch.load(path, weights_only=True)
    torch.save({k: v for k, v in ckpt.items() if k != 'numerics'}, path)
    with pytest.raises(configurator.Stop,
                       match=r'other settings \(dtype and threads, which an older train.py did'):
        train.train(train.get_config(args))
    torch.save(dict(ckpt, rng={'python': [3]}, numerics={'dtype': 'bfloat16', 'threads': 1}), path)
    train.train(train.get_config(args))
    assert 'resuming in bfloat16 on 1 threads as ckpt.pt was trained' in capsys.readouterr().out
    assert json.load(open(tmp_path / 'out' / 'r' / 'config.json'))['dtype'] == 'bfloat16'


def test_a_nan_loss_stops_the_run_and_keeps_its_checkpoint(tmp_path, text_file):
    out = run_killed(tmp_path, tiny_args(tmp_path, text_file, '--run_name=n'), 'nan', 10)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(
        'error: the loss became nan at iteration 11; the run stops (ckpt.pt holds iteration 8)')
    assert torch.load(tmp_path / 'out' / 'n' / 'ckpt.pt', weights_only=True)['iter'] == 8
    assert not (tmp_path / 'out' / 'n' / 'done.json').exists()


def test_two_ddp_processes_match_one_process(tmp_path, text_file):
    args = tiny_args(tmp_path, text_file, '--grad_accum=2', '--model_ckpts=0',
                     '--save_snapshots=False')
    train.train(train.get_config(args + ['--run_name=one']))
    ddp = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2',
                          '--master_port=29533',
                          'train.py', *args, '--run_name=two'], cwd=REPO, capture_output=True,
                         text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='1'), timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    a, b = records(tmp_path / 'out' / 'one'), records(tmp_path / 'out' / 'two')
    for key in ('val_loss', 'train_loss'):
        assert np.allclose([r[key] for r in a if key in r], [r[key] for r in b if key in r],
                           rtol=1e-4)
    assert np.allclose([r['layers'][1]['pr_k'] for r in a], [r['layers'][1]['pr_k'] for r in b],
                       rtol=1e-4)


@pytest.mark.skipif(shutil.which('g++') is None,
                    reason='torch.compile builds C++ on a CPU: no g++ here')
def test_a_compiled_run_gives_the_uncompiled_losses_to_round_off(tmp_path, text_file):
    """torch.compile fuses the forward and backward, which changes only round-off: after 4 steps
    every loss agrees with the uncompiled run's to 1e-5 (relative). In a subprocess, so its compiler
    cache stays in tmp_path."""
    args = tiny_args(tmp_path, text_file, '--max_iters=4', '--eval_interval=2', '--geom_interval=0',
                     '--model_ckpts=0',
                     '--n_layer=1', '--n_embd=16', '--block_size=16', '--batch_size=4')
    eager = records(train.train(train.get_config(args + ['--run_name=eager'])))
    out = run_train(args + ['--compile=True', '--run_name=compiled'], env=dict(
        os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / 'inductor'),
        TORCHINDUCTOR_COMPILE_THREADS='1'))
    assert out.returncode == 0, out.stderr
    compiled = records(tmp_path / 'out' / 'compiled')
    for key in ('train_loss', 'val_loss'):
        assert [r[key] for r in compiled] == pytest.approx([r[key] for r in eager], rel=1e-5)


def test_bf16_autocast_runs_and_its_weight_metrics_are_those_of_its_float32_snapshots(
        tmp_path, text_file):
    run_dir = train.train(cfg_of(tmp_path, text_file, '--dtype=bfloat16', '--max_iters=8'))
    assert json.load(open(os.path.join(run_dir, 'config.json')))['dtype'] == 'bfloat16'
    last = records(run_dir)[-1]
    snap = np.load(f'{run_dir}/snapshots/qk_0000008.npz')
    again = runfolder.logged(geometry.layer_geometry(snap['q'][0], snap['k'][0], 2))
    assert last['layers'][0]['pr_k_head'] == again['pr_k_head']
    assert 0 < last['layers'][0]['entropy'] <= np.log(32)
