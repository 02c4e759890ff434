"""Tests of the analysis on synthetic run folders (write_run plants the study's effects;
test_claims.py uses it too): settings read from config.json, bad records, a missing metric, a broken
config, a cut or compressed log, the output folder's safety, and the row correlations against
geometry's one definition."""
import gzip
import json
import math
import os
import zlib

import numpy as np
import pytest

import analyze
from plumbing import engine, folders
import geometry
from plumbing import stats

ITERS = (0, 1, 2, 4, 8, 16, 32, 50, 64, 100, 150, 200)


def config(**over):
    """A config.json as train.py writes it (every key resolved, provenance included)."""
    cfg = dict(out_dir='out', run_name='run', overwrite=False, eval_interval=50, eval_iters=2,
               geom_interval=50, eval_windows=4, ckpt_interval=100, model_ckpts=0,
               save_snapshots=False, dataset='wikitext103', data_dir='data', data_file='corpus.txt',
               data_url='', cache_dir='', min_char_count=1, n_layer=2, n_head=2, n_embd=16,
               block_size=32, bias=False, dropout=0.0, qk_init='normal', batch_size=8, grad_accum=1,
               max_iters=ITERS[-1], lr=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=0,
               weight_decay=0.1, decay_qk=True, beta1=0.9, beta2=0.99, grad_clip=1.0,
               control='none', control_target='k', control_scope='head', control_keep='fro',
               control_layers='', shrink_to=0.5, shrink_iters=100, control_interval=1, seed=1,
               device='cpu', dtype='float32', compile=False, threads=1, torch='2.13', world_size=1,
               git_commit=None, vocab_size=30, data_sha256='ab' * 32, n_chars=1000,
               data_cache='corpus-x', n_params=1000)
    cfg.update(over)
    return cfg


def layer(rng, f, effect, n_head, i, cfg, noise=1.0, shift=0.0, link=0.2):
    """One layer of one record with every key geometry logs; planted with sign effect: PR_Q up, PR_K
    down, PR_QK and entropy following PR_K (entropy by link across heads, the rest as a shared
    trend); shrink lowering PR_K, freeze holding it; entropy + shift f."""
    k_heads = 4 - effect * 1.5 * f + noise * rng.normal(0, 0.3, n_head)
    if cfg['control'] == 'shrink':
        k_heads = 1.5 + (k_heads - 1.5) * (1 - (1 - cfg['shrink_to']) * f)
    if cfg['control'] == 'freeze':
        k_heads = 4 + noise * rng.normal(0, 0.3, n_head)
    q_heads = 3 + effect * 1.5 * f + noise * rng.normal(0, 0.05, n_head) + 0.1 * i
    qk = np.clip(3 + 0.8 * (k_heads - 4) + noise * rng.normal(0, 0.05, n_head), 1, 8)
    ent = (1.5 + link * (k_heads - 4) - (0.2 - link) * effect * 1.5 * f
           + noise * rng.normal(0, 0.01, n_head) + shift * f)
    scale = 0.03 + 0.01 * f + noise * rng.normal(0, 0.001, n_head)
    lists = {'pr_q_heads': q_heads, 'pr_k_heads': k_heads, 'pr_qk_heads': qk, 'entropy_heads': ent,
             'entropy_norm_heads': ent / 3, 'qk_spec_norm_heads': scale,
             'qk_fro_norm_heads': scale * 1.5, 'tok_pr_q_heads': q_heads - 0.5,
             'tok_pr_k_heads': k_heads - 0.5, 'tok_pr_qk_heads': qk / 2 + 0.5,
             'pr_dq_heads': q_heads, 'pr_dk_heads': k_heads}
    rec = {k: [float(x) for x in v] for k, v in lists.items()}
    for key in ('pr_q', 'pr_k', 'tok_pr_q', 'tok_pr_k', 'pr_dq', 'pr_dk'):
        rec[key + '_head'] = float(np.mean(lists[key + '_heads']))
        rec[key] = 2 * rec[key + '_head']
    for key in ('pr_qk', 'entropy', 'entropy_norm', 'qk_spec_norm', 'qk_fro_norm', 'tok_pr_qk'):
        rec[key] = float(np.mean(lists[key + '_heads']))
    rec['k_spec_norm'], rec['q_spec_norm'] = 0.1 + 0.01 * f, 0.1
    return rec


def write_run(root, name, seed=1, effect=1, noise=1.0, shift=0.0, link=0.2, iters=ITERS, lost=(),
              more=None, done=True, log='metrics.jsonl', **cfg):
    """A finished run folder; lost: metric keys it does not log; more: {key: value} it logs too."""
    path = os.path.join(root, name)
    os.makedirs(path)
    cfg = config(seed=seed, run_name=name, **cfg)
    json.dump(cfg, open(os.path.join(path, 'config.json'), 'w'))
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    lines = []
    for it in iters:
        f = math.log1p(it) / math.log1p(iters[-1])
        layers = [layer(rng, f, effect, cfg['n_head'], i, cfg, noise, shift, link)
                  for i in range(cfg['n_layer'])]
        for lay in layers:
            lay.update({k: v for k, v in (more or {}).items() if k not in lay})
            for key in lost:
                lay.pop(key, None)
        lines.append(json.dumps({'iter': it, 'lr': 1e-3, 'train_loss': 3 - f, 'val_loss': 3.1 - f,
                                 'layers': layers}))
    with (gzip.open if log.endswith('.gz') else open)(os.path.join(path, log), 'wb') as fh:
        fh.write(('\n'.join(lines) + '\n').encode())
    if done:
        json.dump({'iter': iters[-1], 'train_loss': 2.0, 'val_loss': 2.1, 'wall_time': 1.0},
                  open(os.path.join(path, 'done.json'), 'w'))
    return path


def study(root, seeds=3, name='run', **cfg):
    """seeds runs of one setting (cfg), named name_s1, name_s2, ..."""
    return [write_run(str(root), f'{name}_s{s}', seed=s, **cfg) for s in range(1, seeds + 1)]


def quiet(msg):
    pass


def run(paths, out, **kw):
    return analyze.analyze([str(p) for p in paths], out=str(out), figures=False, log=quiet, **kw)


def claim(study, key):
    return next(r for r in study.tables['claims'] if r['key'] == key)


# ------------------------------------------------------------------- settings come from config.json

def test_a_bfloat16_seed_is_a_setting_of_its_own_and_the_report_names_dtype(tmp_path):
    study(tmp_path / 'runs')
    write_run(str(tmp_path / 'runs'), 'run_s4', seed=4, dtype='bfloat16')
    s = run([tmp_path / 'runs'], tmp_path / 'out')
    assert sorted(s.label.values()) == ['base', 'dtype=bfloat16']
    rows = [r for r in s.tables['regime'] if r['statistic'] == 'b']
    assert sorted((r['point'], r['seeds']) for r in rows) == [('base', 3), ('dtype=bfloat16', 1)]
    assert {r['point'] for r in s.tables['regime']} == {'base', 'dtype=bfloat16'}
    report = (tmp_path / 'out' / 'REPORT.md').read_text()
    assert 'in 2 settings that differ in dtype' in report
    assert claim(s, 'c')['n'] == 4 and 'in 2 settings' in claim(s, 'c')['scope']


def test_a_key_a_forker_adds_is_a_setting_and_only_a_true_copy_is_a_duplicate(tmp_path):
    write_run(str(tmp_path), 'plain', seed=1)
    write_run(str(tmp_path), 'rotary', seed=1, rotary=True)
    # the same settings and seed as plain: a duplicate
    write_run(str(tmp_path), 'again', seed=1)
    s = run([tmp_path], tmp_path / 'out')
    assert sorted(r.name for r in s.runs) == ['again', 'rotary']
    assert s.skipped == [(str(tmp_path / 'plain'),
                          f'duplicate of {tmp_path / "again"} (the same settings and seed)')]
    assert sorted(s.label.values()) == ['rotary=None', 'rotary=True']


def test_the_data_is_its_content_hash_not_its_file_name(tmp_path):
    write_run(str(tmp_path), 'a', seed=1, data_file='/old/place/text.txt')
    write_run(str(tmp_path), 'b', seed=2, data_file='/new/place/copy.txt')
    write_run(str(tmp_path), 'c', seed=3, data_sha256='cd' * 32)
    s = run([tmp_path], tmp_path / 'out')
    assert sorted(s.label.values()) == ['base', 'data_sha256=' + 'cd' * 32]


ABSENT = object()
KINDS = ('absent', 'type', 'zero', 'negative', 'huge', 'nan', 'null')
LISTS = ('qk_imbalance', 'qk_gram', 'qk_drift', 'q_spec_norm', 'k_spec_norm', 'ctl_pr',
         'ctl_target_pr')   # train.py logs these per head too
EVERY_KEY = {**dict.fromkeys(geometry.BOUNDS, 1.0), **{f'{k}_heads': [1.0, 1.0] for k in LISTS}}


def faults(value):
    """{kind: a wrong value in place of value} (a string's huge value is a long string)."""
    text = isinstance(value, str)
    huge = 'x' * 999 if text else 10 ** 18 if type(value) is int else 1e300
    return dict(zip(KINDS, (ABSENT, 5 if text else 'x', 0, -1, huge, math.nan, None)))


def changed(d, field, value):
    d = json.loads(json.dumps(d))
    d.pop(field) if value is ABSENT else d.update({field: value})
    return d


def write_folder(path, cfg, recs):
    os.makedirs(path)
    json.dump(cfg, open(f'{path}/config.json', 'w'))
    open(f'{path}/metrics.jsonl', 'w').write('\n'.join(map(json.dumps, recs)) + '\n')
    json.dump({k: recs[-1][k] for k in ('iter', *folders.LOSSES)}, open(f'{path}/done.json', 'w'))
    return path


def expected(field, kind, record):
    """'named' for a value the analysis reads that is absent, of another type, null or NaN (NaN
    anywhere in config.json), a size or max_iters below 1, or a value outside its bounds; 'used' for
    a value it does not read, or 0 in a layer (0.0 is in every range); else None (either)."""
    plain = kind in ('absent', 'type', 'null', 'nan')
    if not record:
        read = {k for keys in folders.REQUIRED.values() for k in keys}
        sizes = kind in ('zero', 'negative') and field in folders.SIZES + ('max_iters',)
        if kind == 'nan' or field in read and (plain or sizes or field == 'control'):
            return 'named'
        return None if field in read else 'used'
    if field in ('iter', 'layers') or field.endswith('_heads'):
        return 'named' if kind != 'absent' or field == 'iter' else None
    if field not in folders.LOSSES and field not in EVERY_KEY and field not in geometry.BOUNDS:
        return 'used'
    low, high = geometry.BOUNDS.get(field, (0, math.inf))
    negative = kind == 'negative' and low > -1   # the fault is -1 (an excess kurtosis may be)
    if kind != 'absent' and plain or negative or kind == 'huge' and high != math.inf:
        return 'named'
    bounding = field in {row[1] for row in geometry.BOUNDS.values()}   # its 0 bounds another
    return 'used' if kind == 'absent' or kind == 'zero' and not bounding else None


def config_faults(root, cfg, recs):
    """{run folder: what is expected} of cfg with each field set to each of KINDS, in turn."""
    cases, read = {}, {k for keys in folders.REQUIRED.values() for k in keys}
    slim = [{**r, 'layers': [{'pr_q': x['pr_q']} for x in r['layers']]} for r in recs]
    for field in cfg:   # a run each, its seed unlike the good runs'
        # the analysis reads most keys only as settings: lr and dtype stand for them there
        where = 'analysed' if field in read | {'lr', 'dtype'} else 'loaded'
        for kind, value in faults(cfg[field]).items():
            wrong = changed({**cfg, 'seed': 100 + len(cases)}, field, value)
            path = write_folder(f'{root}/{where}/{field}-{kind}', wrong, slim)
            cases[path] = expected(field, kind, False)
    return cases


def faulty_record(rec, field, in_layer, value, it):
    """rec at iteration it with field of its top level or of its first layer set to value."""
    if not in_layer:
        return changed({**rec, 'iter': it}, field, value)
    first, second = rec['layers']
    return {**rec, 'iter': it, 'layers': [changed(first, field, value), second]}


def test_a_fault_in_any_field_of_a_config_or_record_stops_at_its_run(tmp_path):
    """Every field of one run's config.json, and of a record (top level and a layer), set in turn to
    each of KINDS (a run a field, a record a kind): the fault is named where the analysis reads the
    field, and the run (the record) used where it does not; the analysis over what is used finishes
    and the good runs' numbers are as before."""
    good = study(tmp_path / 'runs', more=EVERY_KEY)   # every key train.py logs
    clean = run([tmp_path / 'runs'], tmp_path / 'clean')
    cfg = json.load(open(f'{good[0]}/config.json'))
    recs = [json.loads(line) for line in open(f'{good[0]}/metrics.jsonl')]
    first, rec, last, layer = recs[0], recs[5], recs[-1], recs[5]['layers'][0]
    configs, records = config_faults(tmp_path, cfg, [first, last]), {}
    fields = [(k, False, faults(v)) for k, v in rec.items()]
    fields += [(k, True, faults(v)) for k, v in layer.items()]
    fields.append(('layers', False, {'extra layer': [layer] * 3, 'null layer': [None, layer]}))
    fields.append(('pr_k_heads', True, {'long list': [2.0] * 3, 'null in a list': [None, 1.0]}))
    for field, in_layer, wrong in fields:   # a run a field, its seed unlike the others'
        rows = [faulty_record(rec, field, in_layer, v, 10 + i)
                for i, v in enumerate(wrong.values())]
        path = write_folder(f'{tmp_path}/loaded/{field}-{in_layer}-{len(records)}',
                            {**cfg, 'seed': 900 + len(records)}, [first, *rows, last])
        records[path] = (field, in_layer, wrong, [expected(field, k, True) for k in wrong])
    warnings = []
    used = {r.path: r for r in folders.load_runs([str(tmp_path)], warnings.append)[0]}
    named = {p for p in configs if any(w.startswith((f'skipped {p}:', f'{p}:')) for w in warnings)}
    assert [p for p, e in configs.items() if e == 'named' and p not in named] == []
    assert [p for p, e in configs.items() if e == 'used' and p not in used] == []
    for path, (field, in_layer, wrong, want) in records.items():
        its = list(used[path].iters)   # the iterations written, in order, each once
        assert its == sorted(set(its)) and set(its) <= {0, 200, *range(10, 10 + len(want))}, path
        kept = [10 + i in its for i in range(len(want))]
        assert [w for w, k in zip(want, kept) if (w, k) in (('named', 1), ('used', 0))] == [], path
    for i, kind in enumerate(KINDS):   # a run a kind holds every fault of its kind the loader kept
        top = {**rec, 'iter': 10}
        for path, (field, in_layer, wrong, _) in records.items():
            if kind in wrong and 10 + i in used[path].iters:
                top = faulty_record(top, field, in_layer, wrong[kind], 10)
        write_folder(f'{tmp_path}/analysed/{kind}', {**cfg, 'seed': 800 + i}, [first, top, last])
    s = run([tmp_path / 'runs', tmp_path / 'analysed'], tmp_path / 'out')
    rows, used = {r['path']: r for r in s.tables['runs']}, {r.path: r for r in s.runs}
    assert all('\n' not in w for w in s.warnings)
    assert [k for k in KINDS if 10 not in used[f'{tmp_path}/analysed/{k}'].iters] == []
    for r in clean.tables['runs']:   # the good runs' numbers are as before
        assert {**rows[r['path']], 'setting': ''} == {**r, 'setting': ''}
    for r in clean.runs:
        assert all(np.array_equal(r.m[k], used[r.path].m[k], equal_nan=True) for k in r.m)


def test_a_metric_one_seed_did_not_log_leaves_the_other_seeds_in_place(tmp_path):
    study(tmp_path / 'runs', seeds=2)
    write_run(str(tmp_path / 'runs'), 'run_s3', seed=3, lost=('pr_k_heads', 'pr_k_head'))
    s = run([tmp_path / 'runs'], tmp_path / 'out')
    assert any('pr_k_head, pr_k_heads not logged, unlike other seeds of its setting' in w
               for w in s.warnings)
    # (c) per head: 2 seeds; (b): 3 seeds x 2 layers
    assert claim(s, 'c')['n'] == 2 and claim(s, 'b')['n'] == 6
    head = engine.judge(analyze.ALL['b'], s.runs, engine.View('head', 'post'))
    # per head, the 2 seeds that logged PR_K
    assert head['n'] == 4 and head['seeds'] == 2
    whole = engine.judge(analyze.ALL['gap_end'], s.runs)
    assert whole['n'] == 3


# ----------------------------------------------------------------------------- the output folder

def test_the_output_folder_is_never_a_run_folder_or_root_and_foreign_files_stay(tmp_path, capsys):
    study(tmp_path / 'runs')
    for out in ('/', tmp_path / 'runs' / 'run_s1', tmp_path / 'runs' / 'run_s1' / 'analysis'):
        assert analyze.main([str(tmp_path / 'runs'), f'--out={out}', '--no_figures']) == 2
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and ('root' in err or 'run folder' in err)
    assert not os.path.exists(tmp_path / 'runs' / 'run_s1' / 'analysis')
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'REPORT.md').write_text('my notes')
    (out / 'mine.txt').write_text('keep')
    assert analyze.main([str(tmp_path / 'runs'), f'--out={out}', '--no_figures']) == 2
    assert 'REPORT.md' in capsys.readouterr().err and (out / 'REPORT.md').read_text() == 'my notes'
    assert sorted(os.listdir(out)) == ['REPORT.md', 'mine.txt']
    os.remove(out / 'REPORT.md')
    for _ in range(2):   # its own files it replaces; the user's stays
        assert analyze.main([str(tmp_path / 'runs'), f'--out={out}', '--no_figures']) == 0
    assert ((out / 'mine.txt').read_text() == 'keep'
            and 'claims.md' in json.load(open(out / folders.MANIFEST)))
    assert analyze.main([str(tmp_path / 'nothing'), '--no_figures']) == 2


# ----------------------------------------------------------------- statistics shared by every table

def test_the_row_correlations_match_the_one_definition():
    rng = np.random.default_rng(0)
    x, y, z = rng.normal(size=(3, 5, 12))
    y += x + z
    expected = [geometry.partial_correlation(a, b, c) for a, b, c in zip(x, y, z)]
    assert np.allclose(stats.partial_rows(x, y, z), expected)
    assert np.allclose(stats.pearson_rows(x, y),
                       [geometry.partial_correlation(a, b) for a, b in zip(x, y)])
    # ties: average ranks
    assert stats.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)
    assert math.isnan(stats.spearman([1, 1, 1, 1], [1, 2, 3, 4]))


def test_c_does_not_hold_when_pr_k_and_entropy_only_trend_together(tmp_path):
    # both fall over training; across heads, entropy does not follow PR_K
    study(tmp_path, link=0.0)
    s = run([tmp_path], tmp_path / 'out')
    assert claim(s, 'c')['verdict'].split(' (')[0] in ('no effect', 'undecided')
    over_time = engine.judge(analyze.ALL['k~entropy over time'], s.runs)
    # within runs over time the trends correlate anyway: descriptive only
    assert over_time['est'] > 0.9


# ----------------------------------------------------------- settings and faults of the run folders

def test_control_keys_a_run_ignores_split_no_setting_and_a_lacking_key_is_named(tmp_path):
    study(tmp_path, seeds=2, rope=False)
    write_run(str(tmp_path), 'run_s3', seed=3, rope=False, control_keep='spec',
              control_scope='layer', shrink_iters=7)
    write_run(str(tmp_path), 'old_s4', seed=4)   # trained before rope was a key
    for s, over in ((1, {'shrink_to': 0.1}), (2, {'shrink_iters': 5})):
        write_run(str(tmp_path), f'fr_s{s}', seed=s, rope=False, control='freeze', **over)
    warnings = []
    runs, _ = folders.load_runs([str(tmp_path)], warnings.append)
    assert sorted(len(rs) for rs in engine.group(runs, lambda r: r.setting).values()) == [1, 2, 3]
    assert len({r.arm for r in runs if r.control == 'freeze'}) == 1
    assert warnings == [f'{tmp_path / "old_s4"}: config.json lacks rope, which 3 run(s) of '
                        'otherwise the same settings have: kept as a setting of its own']


def test_a_run_without_usable_records_or_whose_log_was_cut_is_skipped_with_one_line(tmp_path):
    paths = study(tmp_path / 'runs', seeds=4)
    gz = write_run(str(tmp_path / 'runs'), 'run_s5', seed=5, log='metrics.jsonl.gz')
    running = write_run(str(tmp_path / 'runs'), 'run_s6', seed=6, done=False)
    lines = open(os.path.join(paths[0], 'metrics.jsonl')).read().splitlines()
    nan = [json.loads(s) for s in lines]
    for layer in (x for rec in nan for x in rec['layers']):
        layer['pr_q'] = math.nan
    writes = {paths[0]: [json.dumps(r) for r in nan], paths[1]: lines[:4], paths[2]: [],
              paths[3]: lines + ['{"iter": 300, "layers": [{"pr_q']}   # a kill while it was written
    for path, text in writes.items():
        open(os.path.join(path, 'metrics.jsonl'), 'w').write('\n'.join(text))
    data = open(os.path.join(gz, 'metrics.jsonl.gz'), 'rb').read()
    open(os.path.join(gz, 'metrics.jsonl.gz'), 'wb').write(data[:len(data) // 2])
    s = run([tmp_path / 'runs'], tmp_path / 'out')
    cut = f'ends at iteration {ITERS[3]}, done.json at {ITERS[-1]}: cut short'
    assert dict(s.skipped) == {
        paths[0]: f'none of its {len(ITERS)} geometry records is usable (the record of iteration '
                  '0 is left out: pr_q is not a finite number)',
        paths[1]: f'metrics.jsonl {cut}', paths[2]: 'metrics.jsonl holds no geometry record',
        running: 'unfinished (no done.json)', gz: dict(s.skipped)[gz]}
    assert dict(s.skipped)[gz].startswith('metrics.jsonl.gz ends at iteration ')
    line = f'metrics line {len(ITERS) + 1} is cut short (a kill while it was written?): left out'
    assert [(r.path, r.notes) for r in s.runs] == [(paths[3], [line])]


def test_linked_run_folders_count_once_a_loop_ends_and_a_link_out_of_the_folders_is_not_followed(
        tmp_path):
    paths = study(tmp_path / 'runs')
    write_run(str(tmp_path / 'other'), 'sibling')   # beside: a link to an ancestor would reach it
    (tmp_path / 'pick').mkdir()
    for name, target in (('all', tmp_path / 'runs'), ('loop', tmp_path / 'pick'), ('one', paths[0]),
                         ('up', tmp_path)):
        os.symlink(target, tmp_path / 'pick' / name)
    left = []
    found = folders.find_runs([str(tmp_path / 'pick'), str(tmp_path / 'runs')], left)
    assert found == [str(tmp_path / 'pick' / 'all' / f'run_s{s}') for s in (1, 2, 3)]
    up = os.path.realpath(tmp_path)
    assert left == [(str(tmp_path / 'pick' / 'up'), f'a link to {up}, outside the folders given')]


def test_impossible_logit_scales_and_a_done_loss_not_logged_are_named(tmp_path):
    path = write_run(str(tmp_path), 'r')
    lines = open(os.path.join(path, 'metrics.jsonl')).read().splitlines()
    rec = json.loads(lines[5])
    rec['layers'][0]['qk_spec_norm_heads'][1] = 1e30
    open(os.path.join(path, 'metrics.jsonl'), 'w').write(
        '\n'.join(lines[:5] + [json.dumps(rec)] + lines[6:]))
    json.dump({'iter': ITERS[-1], 'train_loss': 2.0, 'val_loss': 1e30},
              open(os.path.join(path, 'done.json'), 'w'))
    (r,), _ = folders.load_runs([str(tmp_path)], quiet)
    hi = rec['layers'][0]['qk_fro_norm_heads'][1]
    assert r.notes == [f'the record of iteration {ITERS[5]} is left out: qk_spec_norm_heads = '
                       f'1e+30 outside [0, {hi:.4g}] (from qk_fro_norm_heads)',
                       'done.json has val_loss = 1e+30, not 2.1 as logged at its iteration '
                       f'{ITERS[-1]}: the logged one is used'] and r.final_loss('val_loss') == 2.1


def test_an_out_drops_the_files_it_wrote_before_and_no_other_and_a_bad_manifest_is_one_line(
        tmp_path, capsys):
    out = tmp_path / 'out'
    folders.write_files(str(out), {'a.csv': 'x', 'b.csv': 'y', 'f.png': b'p'})
    (out / 'mine.txt').write_text('keep')
    folders.write_files(str(out), {'a.csv': 'z'})   # as with --no_figures: the figures stay
    assert sorted(os.listdir(out)) == ['.analyze.json', 'a.csv', 'f.png', 'mine.txt']
    (out / 'sub').mkdir()
    for name in (tmp_path / 'theirs.csv', out / 'sub' / 'theirs.csv'):
        name.write_text('keep')
    for manifest in ([str(tmp_path / 'theirs.csv')], ['../theirs.csv'], ['sub/theirs.csv'], 5, '{'):
        (out / folders.MANIFEST).write_text(manifest if manifest == '{' else json.dumps(manifest))
        with pytest.raises(folders.OutError, match='is not a list of file names in'):
            folders.write_files(str(out), {'a.csv': 'z'})
    assert sorted(os.listdir(out)) == ['.analyze.json', 'a.csv', 'f.png', 'mine.txt', 'sub']
    assert (tmp_path / 'theirs.csv').exists() and (out / 'sub' / 'theirs.csv').exists()
    study(tmp_path / 'runs', seeds=1)
    assert analyze.main([str(tmp_path / 'runs'), f'--out={out}', '--no_figures']) == 2
    assert capsys.readouterr().err.count('\n') == 1


def test_an_analysis_stopped_half_way_through_its_files_writes_them_again_on_a_rerun(
        tmp_path, monkeypatch):
    files = {'claims.md': 'one', 'runs.md': 'two', 'fig1.png': b'three'}
    real = open
    def full_disk(path, *args, **kwargs):
        if str(path).endswith('runs.md.tmp'):
            raise OSError(28, 'No space left on device')
        return real(path, *args, **kwargs)
    monkeypatch.setattr('builtins.open', full_disk)
    with pytest.raises(folders.OutError, match='No space left'):
        folders.write_files(str(tmp_path), files)
    monkeypatch.setattr('builtins.open', real)
    assert os.listdir(tmp_path) and (tmp_path / 'claims.md').read_text() == 'one'
    folders.write_files(str(tmp_path), files)
    assert (tmp_path / 'runs.md').read_text() == 'two'
