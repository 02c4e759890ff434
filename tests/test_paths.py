"""The README's paths run whole: a sweep's grid at tiny sizes (depths 4, 6, 8, each qk_init, the
control arms with both keeps, a no-decay arm, a second learning rate) trained by sweep.sh and
analysed at its end, then analysed again beside a pretrained series, and the series alone; and
every committed study analysed again to its committed tables."""
import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import analyze
import control
import geometry
import pretrained
from plumbing import folders
import test_plots as plot_check
from conftest import REPO, make_text

NOT_A_NUMBER = re.compile(r'\b(nan|inf)\b', re.IGNORECASE)
# the committed studies that have been analysed (a study still training has runs but no tables)
STUDIES = sorted(p for p in glob.glob(os.path.join(REPO, 'results', '*', 'runs'))
                 if os.path.exists(os.path.join(os.path.dirname(p), '.analyze.json')))


def sweep(env, *args):
    done = subprocess.run(['bash', os.path.join(REPO, 'sweep.sh'), *args], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.fixture(scope='module')
def swept(tmp_path_factory):
    """The smoke preset's grid with one seed a depth and init and two control seeds, then two more
    settings from a run list, each sweep analysing OUT at its end."""
    root = tmp_path_factory.mktemp('paths')
    (root / 'text.txt').write_text(make_text(30_000), encoding='utf-8')
    env = dict(PRESET='smoke', OUT=str(root / 'out'), DATA_FILE=str(root / 'text.txt'), JOBS='2',
               SEEDS='1', CONTROL_SEEDS='1 2', SHRINK_TOS='0.1', PYTHON=sys.executable)
    grid = sweep({**env, 'ANALYZE': '0'})
    (root / 'runs.txt').write_text('nodecay --n_layer=4 --seed=1 --decay_qk=False\n'
                                   'lr --n_layer=4 --seed=1 --lr=3e-3\n')
    listed = sweep({**env, 'RUN_LIST': str(root / 'runs.txt')})
    return root, env, grid + listed


@pytest.fixture(scope='module')
def series(tmp_path_factory):
    """A pretrained series of three revisions of a tiny random model, as pretrained.py writes it."""
    tf = pytest.importorskip('transformers')
    from test_tokens import build, char_tokenizer
    root = tmp_path_factory.mktemp('series')
    for seed, step in enumerate((0, 4, 16)):
        build(tf, 'gpt_neox', seed).save_pretrained(root / 'model' / f'step{step}')
        char_tokenizer(tf, root / 'model' / f'step{step}')
    (root / 'sample.txt').write_text(make_text(3000), encoding='utf-8')
    args = [f'--model={root / "model"}', '--revisions=step0,step4,step16', '--n_seqs=2',
            f'--text={root / "sample.txt"}', '--seq_len=16', f'--out_dir={root / "out"}']
    assert pretrained.main(args) == 0
    return root / 'out'


def outputs(out):
    """{name: text} of REPORT.md and every table the analysis wrote into out."""
    names = [n for n in os.listdir(out) if n.endswith(('.md', '.csv'))]
    return {n: open(os.path.join(out, n), encoding='utf-8').read() for n in names}


def check_report(out):
    """No traceback's trace: every section filled or saying why, no nan or inf anywhere."""
    files = outputs(out)
    for name, text in files.items():
        found = NOT_A_NUMBER.search(text)
        assert not found, f'{name}: {text[max(found.start() - 200, 0):found.end() + 50]}'
    sections = re.split(r'^## ', files['REPORT.md'], flags=re.M)[1:]
    for section in sections:
        title, _, body = section.partition('\n')
        assert body.strip(), f'section {title} is empty'
    return files


def test_a_sweep_of_every_depth_init_and_arm_analyses_with_nothing_left_out(swept):
    root, _, console = swept
    assert 'Traceback' not in console and 'left out' not in console
    assert 'warning' not in console, console
    runs, _ = folders.load_runs([str(root / 'out')], print)
    for r in runs:   # every key has its bounds, and the token level is read as logged
        assert r.notes == [] and all(k.removesuffix('_heads') in geometry.BOUNDS for k in r.m)
        logged = map(json.loads, open(os.path.join(r.path, 'metrics.jsonl')))
        layers = [rec['layers'] for rec in logged if 'layers' in rec]
        for key in ('tok_pr_q', 'tok_pr_k', 'tok_pr_qk_heads', 'entropy', 'entropy_heads'):
            assert np.array_equal(r.m[key], [[layer[key] for layer in rec] for rec in layers])
    files = check_report(root / 'out' / 'analysis')
    report = files['REPORT.md']
    assert '## What sets entropy' in report and '## Control experiment' in report
    for arm in ('shrink0.1-k', 'shrink0.1-k-spec', 'freeze-k', 'freeze-k-spec'):
        assert arm in files['control_dose.md']
    assert 'decay_qk=False' in files['settings.md'] and 'lr=0.003' in files['settings.md']
    figures = set(os.listdir(root / 'out' / 'analysis'))
    assert {'fig1_pr_over_training.png', 'fig5_control.png', 'fig11_entropy_spread.png'} <= figures


def test_every_figure_of_the_sweep_names_what_it_draws_inside_the_figure(swept, tmp_path):
    root, _, _ = swept
    study = analyze.analyze([str(root / 'out')], out=str(tmp_path), figures=False, log=print)
    drawn, _ = plot_check.figures(study)
    assert {'fig1_pr_over_training', 'fig2_pr_gap', 'fig5_control', 'fig9_regime'} <= set(drawn)
    for stem, figs in drawn.items():
        for fig in figs:
            plot_check.check(fig, stem)


def test_a_rerun_of_the_sweep_trains_nothing_and_a_finished_run_keeps_its_settings(swept):
    root, env, _ = swept
    again = sweep({**env, 'ANALYZE': '0'})
    assert len(again.splitlines()) == 1 and '(18 finished, 0 to train)' in again, again
    name = next(n for n in os.listdir(root / 'out') if n.startswith('L6_normal_s1'))
    (root / 'changed.txt').write_text(f'{name} --n_layer=6 --seed=2\n')
    changed = subprocess.run(['bash', os.path.join(REPO, 'sweep.sh')], cwd=REPO, text=True,
                             env={**os.environ, **env, 'RUN_LIST': str(root / 'changed.txt')},
                             capture_output=True, timeout=60)
    assert changed.returncode == 2 and changed.stderr.count('\n') == 1
    assert f'{name} is finished with other settings (seed 1 there, 2 here)' in changed.stderr


def test_trained_runs_beside_a_pretrained_series_and_the_series_alone_analyse(swept, series,
                                                                              tmp_path, capsys):
    root, _, _ = swept
    assert analyze.main([str(root / 'out'), str(series), f'--out={tmp_path / "both"}',
                         '--no_figures']) == 0
    files = check_report(tmp_path / 'both')
    assert 'pretrained models' in files['token_series.md']
    assert analyze.main([str(series), f'--out={tmp_path / "alone"}']) == 0
    files = check_report(tmp_path / 'alone')
    rows = files['claims.md'].splitlines()[2:]   # the model claims alone
    assert len(rows) == 3 and all('| (f' in row and 'pretrained models: 1 series' in row
                                  for row in rows)


def tables(out):
    """The markdown tables the analysis wrote into out (its manifest's), REPORT.md aside: the .csv
    files hold full float precision, whose last digits vary with the CPU's sums."""
    names = json.load(open(os.path.join(out, '.analyze.json')))
    return {n: open(os.path.join(out, n)).read() for n in names
            if n.endswith('.md') and n != 'REPORT.md'}


def analysed(study, out):
    """A committed study analysed from the repository root, as its README's command does."""
    assert analyze.main([os.path.join('results', study, 'runs'), f'--out={out}', '--no_figures'],
                        ) == 0
    return tables(out)


@pytest.mark.parametrize('study', [p.split(os.sep)[-2] for p in STUDIES])
def test_each_committed_study_analyses_to_its_committed_tables(study, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert analysed(study, tmp_path) == tables(os.path.join(REPO, 'results', study))


def test_the_second_text_beside_the_first_analyses_to_its_committed_tables(tmp_path, monkeypatch):
    """results/sotu-wide/README.md's second command: both texts, compared claim by claim."""
    monkeypatch.chdir(REPO)
    paths = [os.path.join('results', study, 'runs') for study in ('sotu-wide', 'cpu-wide-spread')]
    assert analyze.main([*paths, f'--out={tmp_path}', '--no_figures']) == 0
    assert tables(tmp_path) == tables(os.path.join(REPO, 'results', 'sotu-wide', 'both'))


def test_a_fork_s_new_kind_with_its_own_dose_key_leaves_a_committed_study_as_it_was(
        monkeypatch, tmp_path):
    """The fork's kind caps the top singular value: its dose key is one no committed run has."""
    kinds = {**control.KINDS, 'clip': control.Kind(('control_target', 'clip_to'), 'clip_to')}
    monkeypatch.setattr(control, 'KINDS', kinds)
    monkeypatch.setattr(control, 'KEYS', control.KEYS + ('clip_to',))
    monkeypatch.setattr(control, 'DOSES', control.DOSES + ('clip_to',))
    monkeypatch.chdir(REPO)
    committed = tables(os.path.join(REPO, 'results', 'cpu-wikitext103'))
    assert analysed('cpu-wikitext103', tmp_path) == committed
