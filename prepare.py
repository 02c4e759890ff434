"""
The training text, read and encoded once (nanoGPT's prepare.py): a character vocabulary from the training
part, uint16 train.bin and val.bin, and meta.json, in a cache folder whose name holds the text's SHA-256,
min_char_count and ENCODER_VERSION. WikiText-103 is downloaded into data_dir when it is not there.
"""
import contextlib
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from configurator import Stop

# part of every cache's key: bump it with any change to how the text is read or encoded
ENCODER_VERSION = 1
WIKITEXT = ('wiki.train.raw', 'wiki.valid.raw', 'wiki.test.raw')


def sha256_of(paths):
    h = hashlib.sha256()
    for path in paths:
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                h.update(block)
    return h.hexdigest()


def chunks(path, size=1 << 25):
    with open(path, encoding='utf-8', newline='') as f:  # newline='': '\r' stays
        yield from iter(lambda: f.read(size), '')


def codepoints(text):
    return np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)


def encode(train_chunks, val_chunks, min_count, folder):
    """train.bin, val.bin and meta.json in folder. Characters seen at least min_count times in the training
    part get ids 1.. in code point order; the rest share id 0."""
    counts = np.zeros(0x110000, dtype=np.int64)
    for chunk in train_chunks():
        counts += np.bincount(codepoints(chunk), minlength=0x110000)
    kept = np.flatnonzero(counts >= min_count)
    table = np.zeros(0x110000, dtype=np.uint16)
    table[kept] = np.arange(1, len(kept) + 1)
    meta = dict(encoder_version=ENCODER_VERSION, vocab_size=len(kept) + 1, chars=''.join(map(chr, kept)),
                min_char_count=min_count)
    for split, parts in (('train', train_chunks), ('val', val_chunks)):
        with open(os.path.join(folder, f'{split}.bin'), 'wb') as f:
            meta[f'n_{split}'] = sum(f.write(table[codepoints(c)].tobytes()) for c in parts()) // 2
    with open(os.path.join(folder, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)


def download_wikitext(cfg, need):
    import urllib.request
    import zipfile
    print(f"{', '.join(need)} not in {cfg['data_dir']}: downloading {cfg['data_url']} (about 190 MB)", flush=True)
    os.makedirs(cfg['data_dir'], exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cfg['data_dir']) as tmp:
        try:  # the maintainer's mirror refuses Python's default User-Agent
            req = urllib.request.Request(cfg['data_url'], headers={'User-Agent': 'qkgeom (research code)'})
            with urllib.request.urlopen(req, timeout=60) as r, open(os.path.join(tmp, 'w.zip'), 'wb') as f:
                shutil.copyfileobj(r, f, 1 << 20)
            zipfile.ZipFile(os.path.join(tmp, 'w.zip')).extractall(tmp)
        except OSError as e:
            raise Stop(f"downloading failed ({e}): put {', '.join(need)} of wikitext-103-raw-v1.zip into "
                       f"{cfg['data_dir']}/, or pass --data_file=PATH") from None
        for root, _, names in os.walk(tmp):
            for name in set(names) & set(WIKITEXT):
                os.replace(os.path.join(root, name), os.path.join(cfg['data_dir'], name))


def sources(cfg):
    """(source files, train chunks, val chunks, cache name): data_file or wiki.test.raw split 90/10 by
    characters, or WikiText-103's train and valid files."""
    if cfg['data_file'] or cfg['dataset'] == 'wikitext103-test':
        path = cfg['data_file'] or os.path.join(cfg['data_dir'], 'wiki.test.raw')
        if not cfg['data_file'] and not os.path.isfile(path):
            download_wikitext(cfg, ['wiki.test.raw'])
        if not os.path.isfile(path):
            raise Stop(f'data_file={path} is not a file')
        text = lambda: open(path, encoding='utf-8', newline='').read()
        cut = lambda t: int(0.9 * len(t))
        return [path], lambda: [(t := text())[:cut(t)]], lambda: [(t := text())[cut(t):]], os.path.basename(path)
    paths = [os.path.join(cfg['data_dir'], n) for n in WIKITEXT[:2]]
    if not all(map(os.path.isfile, paths)):
        download_wikitext(cfg, list(WIKITEXT[:2]))
    return paths, lambda: chunks(paths[0]), lambda: chunks(paths[1]), 'wikitext103'


def prepare_data(cfg):
    """(train, val, meta): the encoded text as uint16 memmaps, built into the cache the first time."""
    paths, train_chunks, val_chunks, name = sources(cfg)
    digest = sha256_of(paths)
    key = f"{name}-{digest[:16]}-min{cfg['min_char_count']}-enc{ENCODER_VERSION}"
    root = cfg['cache_dir'] or os.environ.get('QKGEOM_CACHE') or os.path.expanduser('~/.cache/qkgeom')
    folder = os.path.join(root, key)
    if not os.path.isfile(os.path.join(folder, 'meta.json')):  # encoded aside, then renamed: complete or absent
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix='.building-', dir=root, ignore_cleanup_errors=True) as tmp:
            encode(train_chunks, val_chunks, cfg['min_char_count'], tmp)
            with contextlib.suppress(OSError):  # another process may have built it first
                os.rename(tmp, folder)
        print(f'encoded {name} into {folder}', flush=True)
    with open(os.path.join(folder, 'meta.json')) as f:
        meta = json.load(f)
    meta.update(sha256=digest, cache_key=key)
    if meta['n_val'] < cfg['block_size'] + 2:
        raise Stop(f"{', '.join(paths)}: {meta['n_val']} validation characters, too few for block_size="
                   f"{cfg['block_size']}; use a longer text or a smaller --block_size")
    train, val = (np.memmap(os.path.join(folder, f'{s}.bin'), dtype=np.uint16, mode='r') for s in ('train', 'val'))
    return train, val, meta
