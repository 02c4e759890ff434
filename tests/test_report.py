"""REPORT.md and the figures: full colour, a colour per series, legends clear of the data, values
drawn as plain text, intervals as [lo, hi], rules on the side where their claim holds, a warning at
small n, this call's figures."""
import dataclasses
import itertools
import math
import re

import numpy as np
from PIL import Image

import analyze
import plots
import report
from plumbing import engine
import test_analyze as synth


def test_figures_and_report_of_a_mixed_folder_with_odd_setting_names(tmp_path):
    for name, lr, note, control in (('z', 1e-3, 'plain', 'none'), ('y', 3e-3, 'plain', 'none'),
                                    ('x', 3e-3, '$x^$_ long' * 7, 'none'),
                                    ('w', 1e-3, 'plain', 'shrink')):
        # mathtext, long names
        synth.study(tmp_path / 'runs', 2, name, lr=lr, note=note, control=control)
    s = analyze.analyze([str(tmp_path / 'runs')], out=str(tmp_path / 'out'), log=synth.quiet)
    # by value: lr, then note; base named by its values of the settings that vary
    assert list(plots.settings_of(s))[::2] == ['lr=0.001', 'base: lr=0.003, note=plain']
    # no palette
    assert all(Image.open(p).mode in ('RGB', 'RGBA') for p in s.files if p.endswith('.png'))
    text = (tmp_path / 'out' / 'REPORT.md').read_text()
    assert ('**These verdicts rest on n = 2 seeds per setting' in text
            and '(fig9_regime.png)' in text)
    pairs = [(float(a.strip('%')), float(b.strip('%')))
             for a, b in re.findall(r'\[([-+\d.e%]+), ([-+\d.e%]+)\]', text)]
    assert len(pairs) > 20 and all(lo <= hi for lo, hi in pairs)
    for f in (f for f in plots.FIGURES
              if f.stem.split('_')[0] in ('fig1', 'fig2', 'fig3', 'fig5', 'fig9')):
        for fig in np.atleast_1d(f.fn(s, s.tables)):
            fig.draw_without_rendering()
            for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
                styles = [(str(h.get_color()), h.get_linestyle(), h.get_marker())
                          for h in legend.legend_handles]
                assert len(set(styles)) == len(styles), f.stem
                assert not any(legend.get_window_extent().overlaps(ax.get_window_extent())
                               for ax in fig.axes)
            assert min(ax.get_window_extent().height for ax in fig.axes) > 100, f.stem
            titles = [ax.title.get_window_extent() for ax in fig.axes if ax.get_title()]
            assert not any(a.overlaps(b) for a, b in itertools.combinations(titles, 2)), f.stem
    analyze.analyze([str(tmp_path / 'runs')], out=str(tmp_path / 'out'), figures=False,
                    log=synth.quiet)
    text = (tmp_path / 'out' / 'REPORT.md').read_text()
    assert '.png)' not in text and 'Nothing to show: figures not drawn (--no_figures)' in text


def test_each_printed_rule_puts_holds_on_the_side_where_its_claim_holds():
    for claim in (dataclasses.replace(c, fn=lambda v, view: v) for c in analyze.CLAIMS
                  if c.unit != 'trajectory'):
        ref = math.log(claim.ref) if claim.log else claim.ref   # a log claim's values are logs
        sides = [side for side, sign in (('above', 1), ('below', -1)) if engine.judge(
            claim, [ref + sign * x for x in (0.5, 0.55, 0.45)])['verdict'] == 'holds']
        assert sides and f'holds if it lies {sides[0]} {claim.ref:g}' in report.rule(
            claim, analyze.REFERENCES)
    assert f"below {analyze.WELL_BELOW:.0%} of the baseline's" in report.rule(
        analyze.ALL['d'], analyze.REFERENCES)
