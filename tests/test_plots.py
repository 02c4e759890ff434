"""Every figure of a mixed study is usable as it is: each series drawn is named in a legend (a colour
map has a colour bar of its own panel), every legend lies inside the figure, and no panel is empty;
regime rows come grouped by the settings a point varies; a figure without data is not drawn."""
import numpy as np
import pytest
from matplotlib.colors import to_rgb

import analyze
import plots
import test_analyze as synth

IMBALANCE = {'qk_imbalance': 0.3, 'qk_imbalance_heads': [0.2, 0.4], 'qk_drift': 0.1,
             'qk_drift_heads': [0.1, 0.1]}
SPREAD = {'logit_std': 1.5, 'logit_std_heads': [1.0, 2.0]}


def data(artist, ax):
    """Whether artist draws a finite point in ax's data coordinates (not an axhline, say)."""
    if hasattr(artist, 'get_xydata'):
        xy = artist.get_xydata() if artist.get_transform() == ax.transData else []
    elif len(artist.get_offsets()) > 1 or np.ndim(artist.get_array()):
        xy = artist.get_offsets()
    else:
        xy = [v for path in artist.get_paths() for v in path.vertices]
    return bool(len(xy)) and np.isfinite(np.asarray(xy, dtype=float)).all(1).any()


def rgb(artist):
    """The colours artist draws in, as rounded RGB."""
    if hasattr(artist, 'get_color') and not hasattr(artist, 'get_facecolor'):
        colours = [artist.get_color()]
    else:
        colours = list(artist.get_facecolor()) or list(artist.get_edgecolor())
    return {tuple(np.round(to_rgb(c), 3)) for c in colours}


def check(fig, stem):
    """The figure's series each named (a colour in a legend, or a colour map with its own bar),
    its legends inside it, no empty panel."""
    fig.suptitle(stem)
    fig.canvas.draw()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    named = set().union(*[rgb(h) for lg in legends for h in lg.legend_handles])
    for lg in legends:
        box, page = lg.get_window_extent(), fig.bbox
        assert (box.x0 >= page.x0 - 1 and box.y0 >= page.y0 - 1 and box.x1 <= page.x1 + 1
                and box.y1 <= page.y1 + 1), (stem, box, page)
    panels = [ax for ax in fig.axes if ax.get_label() != '<colorbar>']
    mapped = [c for ax in panels for c in ax.collections if np.ndim(c.get_array()) and data(c, ax)]
    bars = [c.colorbar.ax for c in mapped if c.colorbar]
    assert len(bars) == len(mapped) == len(set(bars)), f'{stem}: a colour bar per mapped panel'
    for ax in panels:
        drawn = [a for a in ax.lines + ax.collections if data(a, ax)]
        assert drawn, f'{stem}: an empty panel titled {ax.get_title()!r}'
        for a in (a for a in drawn if a not in mapped):
            assert rgb(a) <= named, f'{stem}: {ax.get_title()!r} draws a series no legend names'


def figures(study):
    """{stem: [figures]} of every figure fn that draws for study; {stem: reason} of the skipped."""
    made, skipped = {}, {}
    for f in plots.FIGURES:
        try:
            out = f.fn(study, study.tables)
        except plots.Skip as e:
            skipped[f.stem] = str(e)
            continue
        if out != []:
            made[f.stem] = out if isinstance(out, list) else [out]
    return made, skipped


def test_every_figure_of_a_mixed_study_names_its_series_inside_the_figure(tmp_path):
    """Two depths, an lr, a width, a shrink family of two doses and a freeze arm; one setting that
    does not log PR_QK: every figure passes check, fig1 names each layer of the deepest runs, fig9
    puts base first (named by its settings), then each varied setting's points in its own block."""
    runs = tmp_path / 'runs'
    for name, cfg in (('base', {}), ('deep', {'n_layer': 3}), ('lr', {'lr': 3e-3}),
                      ('wide', {'n_embd': 32}), ('wider', {'n_embd': 64, 'lost': ('pr_qk',)}),
                      ('shrink5', {'control': 'shrink'}),
                      ('shrink3', {'control': 'shrink', 'shrink_to': 0.3}),
                      ('freeze', {'control': 'freeze'})):
        synth.study(runs, 2, name, more=IMBALANCE, **cfg)
    s = analyze.analyze([str(runs)], out=str(tmp_path / 'out'), figures=False, log=synth.quiet)
    made, skipped = figures(s)
    assert set(made) == {'fig1_pr_over_training', 'fig2_pr_gap', 'fig3_entropy_and_pr',
                         'fig5_control', 'fig9_regime', 'fig10_imbalance'}, skipped
    for stem, figs in made.items():
        for fig in figs:
            check(fig, stem)
    legend = [t.get_text() for t in made['fig1_pr_over_training'][0].legends[0].get_texts()]
    assert legend == ['PR_Q', 'PR_K', 'layer 0', 'layer 1', 'layer 2']
    rows = [t.get_text() for t in made['fig9_regime'][0].axes[0].get_yticklabels()]
    assert rows == ['base: n_layer=2, n_embd=16, lr=0.001', 'n_layer=3', 'n_embd=32',
                    'n_embd=64', 'lr=0.003']
    assert [ax.get_title() for ax in made['fig5_control'][0].axes[:2]] == [
        'freeze-k: pr_k_head', 'freeze-k: entropy']


def test_one_run_draws_no_empty_panel_and_the_report_says_why_a_figure_is_missing(tmp_path):
    """One run that logs logit_std: fig11 draws its heads; the seed-pair figure is not drawn, and
    the report says why; with a controlled pair it is drawn, every arm named."""
    synth.study(tmp_path / 'one', 1, more=SPREAD)
    s = analyze.analyze([str(tmp_path / 'one')], out=str(tmp_path / 'out'), log=synth.quiet)
    made, skipped = figures(s)
    assert 'fig11_entropy_spread' in made and 'fig12_spread_pairs' in skipped
    for stem, figs in made.items():
        for fig in figs:
            check(fig, stem)
    report = (tmp_path / 'out' / 'REPORT.md').read_text()
    assert f'figure skipped: fig12_spread_pairs: {skipped["fig12_spread_pairs"]}' in report
    synth.study(tmp_path / 'one', 1, 'shrink', control='shrink', more=SPREAD)
    s = analyze.analyze([str(tmp_path / 'one')], out=str(tmp_path / 'out2'), figures=False,
                        log=synth.quiet)
    made, skipped = figures(s)
    check(made['fig12_spread_pairs'][0], 'fig12_spread_pairs')


def test_check_refuses_an_unnamed_series_a_clipped_legend_a_shared_colour_bar_an_empty_panel():
    def fig_with(fault):
        fig, (a, b) = plots.panels(2)
        a.plot([0, 1], [0, 1], color='C0', label='named')
        dots = [ax.scatter([0, 1], [1, 0], c=[0, 1]) for ax in (a, b)]
        if fault != 'shared bar':
            fig.colorbar(dots[0], ax=a)
        fig.colorbar(dots[1], ax=[a, b] if fault == 'shared bar' else b)
        if fault == 'unnamed':
            b.plot([0, 1], [1, 1], color='C1')
        if fault == 'empty':
            b.plot([0, 1], [np.nan, np.nan], color='C0')
            dots[1].remove()
        a.legend(loc='upper left', bbox_to_anchor=(3 if fault == 'clipped' else 0, 1))
        return fig
    check(fig_with(None), 'fine')
    for fault, says in (('unnamed', 'no legend names'), ('clipped', 'Bbox'),
                        ('shared bar', 'colour bar'), ('empty', 'empty panel')):
        with pytest.raises(AssertionError, match=says):
            check(fig_with(fault), fault)


def test_the_layer_control_figure_draws_every_arm_in_every_layer_and_fills_the_controlled_one():
    rows = [{'setting': 'base', 'arm': arm, 'layer': layer, 'controlled': layer == chosen,
             'dH': 0.1 * (layer == chosen), 'lo': -0.05, 'hi': 0.15 if layer else float('nan')}
            for arm, chosen in (('freeze-k-spec control_layers=0', 0),
                                ('shrink0.1-k-spec control_layers=2', 2)) for layer in range(3)]
    figure = plots.layer_control(None, {'entropy_layers': rows})
    check(figure, 'fig13_layer_control')
    markers = [line for line in figure.axes[0].lines if len(line.get_xdata()) == 1]
    filled = [line.get_markerfacecolor() != 'white' for line in markers]
    assert len(markers) == 6 and filled == [True, False, False, False, False, True]
    assert plots.layer_control(None, {'entropy_layers': []}) == []
