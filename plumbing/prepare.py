"""The training text, read and encoded once (nanoGPT's prepare.py): a character vocabulary from the
training part, uint16 train.bin and val.bin, and meta.json, in a cache folder whose name holds the
text's SHA-256, min_char_count and ENCODER_VERSION.
WikiText-103 is downloaded into data_dir when it is not there."""
import json
import os
import shutil
import tempfile
from functools import partial

import numpy as np

from plumbing.configurator import Stop, sha256_of

# part of every cache's key: bump it with any change to how the text is read or encoded
ENCODER_VERSION = 1
WIKITEXT = ('wiki.train.raw', 'wiki.valid.raw', 'wiki.test.raw')


def pieces(path, start=0, stop=None):
    """Characters start..stop of a UTF-8 file in pieces, as written ('\r' stays), so that memory
    does not grow with the text. A byte that is not UTF-8 is a Stop naming its offset."""
    pos = 0
    with open(path, encoding='utf-8', newline='') as f:
        try:
            while text := f.read(1 << 22):
                yield text[max(start - pos, 0):None if stop is None else max(stop - pos, 0)]
                pos += len(text)
        except UnicodeDecodeError as e:  # e.object: the bytes decoded, up to where the file is read
            offset = f.buffer.tell() - len(e.object) + e.start
            raise Stop(f'{path} is not UTF-8: byte {offset} ({e.reason}); '
                       'convert it to UTF-8 (for example with iconv)') from None


def codepoints(text):
    return np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)


def encode(train_pieces, val_pieces, min_count, folder):
    """train.bin, val.bin and meta.json in folder. Characters seen at least min_count times in the
    training part get ids 1.. in code point order; the rest share id 0."""
    counts = np.zeros(0x110000, dtype=np.int64)
    for piece in train_pieces():
        counts += np.bincount(codepoints(piece), minlength=0x110000)
    kept = np.flatnonzero(counts >= min_count)
    if len(kept) > np.iinfo(np.uint16).max:
        raise Stop(f'{len(kept)} characters occur at least min_char_count={min_count} times, '
                   'more than uint16 ids hold (65535); raise --min_char_count')
    table = np.zeros(0x110000, dtype=np.uint16)
    table[kept] = np.arange(1, len(kept) + 1)
    meta = dict(encoder_version=ENCODER_VERSION, vocab_size=len(kept) + 1,
                chars=''.join(map(chr, kept)), min_char_count=min_count)
    for split, parts in (('train', train_pieces), ('val', val_pieces)):
        with open(os.path.join(folder, f'{split}.bin'), 'wb') as f:
            meta[f'n_{split}'] = sum(f.write(table[codepoints(p)].tobytes()) for p in parts()) // 2
    with open(os.path.join(folder, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)


def download_wikitext(cfg, need):
    import urllib.request
    import zipfile
    print(f"{', '.join(need)} not in {cfg['data_dir']}: downloading {cfg['data_url']} "
          "(about 190 MB)", flush=True)
    # data_dir is made only on success; meanwhile the download lies in its nearest existing folder
    anchor = os.path.abspath(cfg['data_dir'])
    while not os.path.isdir(anchor):
        anchor = os.path.dirname(anchor)
    try:
        with tempfile.TemporaryDirectory(dir=anchor) as tmp:
            # the maintainer's mirror refuses Python's default User-Agent
            headers = {'User-Agent': 'qkgeom (research code)'}
            request = urllib.request.Request(cfg['data_url'], headers=headers)
            zip_path = os.path.join(tmp, 'w.zip')
            with urllib.request.urlopen(request, timeout=60) as r, open(zip_path, 'wb') as f:
                shutil.copyfileobj(r, f, 1 << 20)
            zipfile.ZipFile(zip_path).extractall(tmp)
            os.makedirs(cfg['data_dir'], exist_ok=True)
            for root, _, names in os.walk(tmp):
                for name in set(names) & set(WIKITEXT):
                    os.replace(os.path.join(root, name), os.path.join(cfg['data_dir'], name))
    except (OSError, zipfile.BadZipFile) as e:
        raise Stop(f"downloading failed ({e}): put {', '.join(need)} of wikitext-103-raw-v1.zip "
                   f"into {cfg['data_dir']}/, or pass --data_file=PATH") from None


def sources(cfg):
    """(source files, train pieces, val pieces, cache name): data_file or wiki.test.raw,
    split 90/10 by characters, or WikiText-103's train and valid files."""
    if cfg['data_file'] or cfg['dataset'] == 'wikitext103-test':
        path = cfg['data_file'] or os.path.join(cfg['data_dir'], 'wiki.test.raw')
        if not os.path.isfile(path):  # get_config has checked data_file
            download_wikitext(cfg, ['wiki.test.raw'])
        cut = int(0.9 * sum(map(len, pieces(path))))
        train_pieces, val_pieces = partial(pieces, path, 0, cut), partial(pieces, path, cut)
        return [path], train_pieces, val_pieces, os.path.basename(path)
    paths = [os.path.join(cfg['data_dir'], n) for n in WIKITEXT[:2]]
    if not all(map(os.path.isfile, paths)):
        download_wikitext(cfg, list(WIKITEXT[:2]))
    return paths, partial(pieces, paths[0]), partial(pieces, paths[1]), 'wikitext103'


def build(folder, name, encode_into):
    """The cache folder, encoded aside and renamed into place: complete or absent.
    Processes that start on one text together (DDP ranks) each encode it;
    the first rename wins, and the others find it built."""
    root = os.path.dirname(folder)
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix='.building-', dir=root,
                                         ignore_cleanup_errors=True) as tmp:
            encode_into(tmp)
            os.rename(tmp, folder)
        print(f'encoded {name} into {folder}', flush=True)
    except OSError as e:
        if not os.path.isfile(os.path.join(folder, 'meta.json')):
            raise Stop(f'cannot write the data cache {root} (cache_dir): {e.strerror}') from None


def prepare_data(cfg):
    """(train, val, meta): the encoded text as uint16 memmaps, the cache built the first time."""
    paths, train_pieces, val_pieces, name = sources(cfg)
    digest = sha256_of(paths)
    key = f"{name}-{digest[:16]}-min{cfg['min_char_count']}-enc{ENCODER_VERSION}"
    default_root = os.path.expanduser('~/.cache/qkgeom')
    root = cfg['cache_dir'] or os.environ.get('QKGEOM_CACHE') or default_root
    folder = os.path.join(root, key)
    if not os.path.isfile(os.path.join(folder, 'meta.json')):  # a built cache may be read-only
        build(folder, name, partial(encode, train_pieces, val_pieces, cfg['min_char_count']))
    meta = dict(json.load(open(os.path.join(folder, 'meta.json'))), sha256=digest, cache_key=key)
    if meta['n_val'] < cfg['block_size'] + 2:
        raise Stop(f"{', '.join(paths)}: {meta['n_val']} validation characters, too few for "
                   f"block_size={cfg['block_size']}; use a longer text or a smaller --block_size")
    train, val = (np.memmap(os.path.join(folder, f'{split}.bin'), dtype=np.uint16, mode='r')
                  for split in ('train', 'val'))
    return train, val, meta
