"""wandb_log: each record to Weights & Biases, in offline mode (no account, no network); off, wandb
is never imported."""
import importlib.util
import json
import os
import pathlib
import struct
import sys
import types

import pytest

from plumbing import configurator
import train
from conftest import records, run_train, tiny_args


def test_off_imports_nothing_and_a_missing_or_refusing_wandb_is_one_line_touching_nothing(
        tmp_path, text_file, monkeypatch):
    monkeypatch.setitem(sys.modules, 'wandb', None)   # any import of wandb fails
    args = tiny_args(tmp_path, text_file, '--max_iters=2', '--run_name=r')
    train.train(train.get_config(args))
    with pytest.raises(configurator.Stop, match=r'^wandb_log=True needs wandb \(.*\): pip install '
                                                r'wandb$'):
        train.train(train.get_config(args + ['--wandb_log=True', '--run_name=w']))
    assert not (tmp_path / 'out' / 'w').exists()
    # a wandb that refuses to start (not logged in): one line, and the old run as it was
    run_dir = tmp_path / 'out' / 'r'
    files = {p: p.read_bytes() for p in run_dir.rglob('*') if p.is_file()}

    def refuse(**settings):
        raise RuntimeError('api_key not configured (no-tty)\ncall wandb.login(key=[your_api_key])')
    monkeypatch.setitem(sys.modules, 'wandb', types.SimpleNamespace(init=refuse))
    with pytest.raises(configurator.Stop, match=r'^wandb.init failed \(api_key not configured '
                                                r'\(no-tty\)\): wandb login, or WANDB_MODE'):
        train.train(train.get_config(args + ['--wandb_log=True', '--overwrite=True']))
    assert {p: p.read_bytes() for p in run_dir.rglob('*') if p.is_file()} == files


def wandb_records(path):
    """The records of an offline run's .wandb file: LevelDB's log format (a 7-byte header, then
    32 KiB blocks of chunks, each with a 7-byte header: checksum, length, type) around wandb's own
    protobuf Record."""
    from wandb.proto import wandb_internal_pb2
    data, i, parts, block = pathlib.Path(path).read_bytes(), 7, b'', 1 << 15
    assert data[:4] == b':W&B'
    while i + 7 <= len(data):
        if block - i % block < 7:   # a block's tail too short for a header is padding
            i += block - i % block
            continue
        _, length, kind = struct.unpack('<IHB', data[i:i + 7])
        parts, i = parts + data[i + 7:i + 7 + length], i + 7 + length
        if kind in (1, 4):   # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b''


@pytest.mark.skipif(importlib.util.find_spec('wandb') is None,
                    reason='wandb is not installed (optional: pip install wandb)')
def test_an_offline_wandb_run_holds_the_config_and_every_record_s_values(tmp_path, text_file):
    env = dict(os.environ, WANDB_MODE='offline', WANDB_DIR=str(tmp_path), WANDB_SILENT='true')
    out = run_train(tiny_args(tmp_path, text_file, '--run_name=r', '--wandb_log=True'), env=env)
    assert out.returncode == 0, out.stderr
    found = list(tmp_path.glob('wandb/offline-run-*/run-*.wandb'))
    assert len(found) == 1
    history, runs = {}, []
    for record in wandb_records(found[0]):
        kind = record.WhichOneof('record_type')
        if kind == 'history':
            row = {item.key or '/'.join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            history[row.pop('_step')] = row
        runs += [record.run] if kind == 'run' else []
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    # some wandb versions write each value as {'value': ...}
    config = {k: v['value'] if isinstance(v, dict) and 'value' in v else v
              for k, v in config.items()}
    assert runs[0].display_name == 'r' and runs[0].project == 'qkgeom'
    assert config['n_layer'] == 2 and config['wandb_log'] is True and 'git_commit' in config
    logged = records(tmp_path / 'out' / 'r')
    assert sorted(history) == [r['iter'] for r in logged]
    for r in logged:
        row = history[r['iter']]
        assert row['lr'] == r['lr'] and row['loss/eval'] == r['eval_loss']
        assert row.get('loss/val') == r.get('val_loss')
        for layer, values in enumerate(r['layers']):
            numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
            assert len(numbers) > 20 and all(
                row[f'geometry/L{layer}/{k}'] == v for k, v in numbers.items()), (r['iter'], layer)
