"""
Data preparation: the training text read, its vocabulary built and the characters encoded once into uint16
train.bin and val.bin (nanoGPT's prepare.py), in a cache folder keyed by the text's SHA-256, min_char_count and
ENCODER_VERSION, and checked against its checksums whenever it is opened. WikiText-103 is downloaded into
data_dir when it is not there. train.py calls prepare_data(cfg); nothing here is needed to change the science.
"""
import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time

import numpy as np

from configurator import Stop, not_utf8, read_utf8
from runfolder import disk_error, read_json, writing

# part of every cache's key: bump it with any change to how the text is read, the vocabulary built or the
# characters encoded, so that a cache made by other encoding code is never reused
ENCODER_VERSION = 1
BINS = ('train.bin', 'val.bin')


def cache_root(cfg):
    return cfg['cache_dir'] or os.environ.get('QKGEOM_CACHE') or os.path.expanduser('~/.cache/qkgeom')


def sha256_of(paths):
    h = hashlib.sha256()
    for path in paths:
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                h.update(block)
    return h.hexdigest()


def file_stamp(path):
    """What changes when a file is rewritten: its size, modification time and inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def remember(obj, path):
    """Best effort: a small JSON file written whole (a unique temporary name, then renamed), or nothing
    where it cannot be written (a read-only cache still works: it is only hashed again)."""
    tmp = f'{path}.{os.getpid()}.tmp'
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, 'w') as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    with contextlib.suppress(OSError):
        os.remove(tmp)


def digest_of(paths, memo):
    """SHA-256 of the files, remembered in the JSON file memo with their size, mtime and inode: files left
    unchanged since are not read again (WikiText-103 is 540 MB), and any rewrite, same length or not, is."""
    stamp = [file_stamp(p) for p in paths]
    try:
        known = read_json(memo)
    except (OSError, ValueError):
        known = {}
    if known.get('stamp') != stamp or not isinstance(known.get('sha256'), str):
        known = {'stamp': stamp, 'sha256': sha256_of(paths)}
        remember(known, memo)
    return known['sha256']


def text_chunks(path, size=1 << 25):
    with open(path, encoding='utf-8', newline='') as f:  # newline='': '\r' stays, as in a --data_file text
        try:
            yield from iter(lambda: f.read(size), '')
        except UnicodeDecodeError as e:
            raise not_utf8(path, 'the text', e.reason) from None


def codepoints(text):
    """A str as a numpy array of Unicode code points, without a Python-level loop."""
    return np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)


def build_vocab(train_chunks, min_count):
    """Characters seen at least min_count times in train, sorted; id 0 is the unknown character."""
    counts = np.zeros(0x110000, dtype=np.int64)
    for chunk in train_chunks:
        counts += np.bincount(codepoints(chunk), minlength=0x110000)
    kept = np.flatnonzero(counts >= min_count)
    if counts.any() and not len(kept):
        raise Stop(f'every character of the training text occurs fewer than min_char_count={min_count} times: the '
                   f'vocabulary would be the unknown id alone; lower --min_char_count or use a longer text')
    if len(kept) + 1 > 65535:
        raise Stop(f'{len(kept)} distinct characters do not fit uint16; raise min_char_count')
    return kept, counts


def encode_to(chunks, table, path):
    """Encode text chunks through a code point -> id table into a uint16 file; returns its length and the
    SHA-256 of its bytes (computed as they are written, so the checksum costs no second read)."""
    n, h = 0, hashlib.sha256()
    with open(path, 'wb') as f:
        for chunk in chunks:
            ids = table[codepoints(chunk)].tobytes()
            f.write(ids)
            h.update(ids)
            n += len(ids) // 2
    return n, h.hexdigest()


def encode_dataset(train_chunks, val_chunks, min_count, out_dir, source):
    """train.bin, val.bin (uint16, nanoGPT style) and meta.json (with their checksums) in out_dir."""
    kept, counts = build_vocab(train_chunks(), min_count)
    table = np.zeros(0x110000, dtype=np.uint16)
    table[kept] = np.arange(1, len(kept) + 1, dtype=np.uint16)
    n_train, train_sha = encode_to(train_chunks(), table, os.path.join(out_dir, 'train.bin'))
    n_val, val_sha = encode_to(val_chunks(), table, os.path.join(out_dir, 'val.bin'))
    meta = dict(source, encoder_version=ENCODER_VERSION, vocab_size=len(kept) + 1, chars=''.join(map(chr, kept)),
                min_char_count=min_count,
                n_train=n_train, n_val=n_val, n_unknown_train=int(counts.sum() - counts[kept].sum()),
                train_sha256=train_sha, val_sha256=val_sha)
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)
    for name, sha in zip(BINS, (train_sha, val_sha)):  # hashed as written: no second read to verify them
        remember({'stamp': [file_stamp(os.path.join(out_dir, name))], 'sha256': sha}, memo_of(out_dir, name))
    return meta


def memo_of(folder, name):
    return os.path.join(folder, f'.{name}.sha256')


WIKITEXT = ('wiki.train.raw', 'wiki.valid.raw', 'wiki.test.raw')


def download_wikitext(cfg, need):
    """Fetch and unzip the raw WikiText-103 release into data_dir, or say which files to put where."""
    import urllib.request  # only here: most runs never download
    import zipfile
    data_dir = cfg['data_dir']
    parent = os.path.dirname(os.path.abspath(data_dir))
    made = [p for p in (parent, os.path.abspath(data_dir)) if not os.path.isdir(p)]  # removed again if left empty
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix='.download-', dir=parent)
        zip_path = os.path.join(tmp, 'wikitext-103-raw-v1.zip')
        print(f"downloading {cfg['data_url']} (about 190 MB) ...")
        # the maintainer's mirror refuses Python's default User-Agent
        req = urllib.request.Request(cfg['data_url'], headers={'User-Agent': 'qkgeom/0.1 (research code)'})
        with urllib.request.urlopen(req, timeout=60) as r, open(zip_path, 'wb') as f:
            shutil.copyfileobj(r, f, 1 << 20)
        with zipfile.ZipFile(zip_path) as z:
            z.extractall(tmp)
        found = [root for root, _, files in os.walk(tmp) if set(WIKITEXT) <= set(files)]
        if not found:
            raise OSError('the archive does not hold ' + ', '.join(WIKITEXT))
        os.makedirs(data_dir, exist_ok=True)
        for name in WIKITEXT:
            os.replace(os.path.join(found[0], name), os.path.join(data_dir, name))
    except (OSError, zipfile.BadZipFile) as e:  # URLError and timeouts are OSErrors
        files = ' and '.join(os.path.join(data_dir, n) for n in need)
        raise Stop(f"{files} {'is' if len(need) == 1 else 'are'} not there and downloading {cfg['data_url']} "
                   f"failed ({e}). Put {' and '.join(need)} from wikitext-103-raw-v1.zip into {data_dir}/ (or pass "
                   f"--data_dir=FOLDER holding them), or train on any local UTF-8 text with --data_file=PATH") from None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(folder)   # only an empty one goes


def text_file(path, what):
    """A regular file to read the text from, or one line saying what path is instead."""
    if not os.path.exists(path):
        raise Stop(f'{what} {path} does not exist; pass the path of a UTF-8 text file')
    if os.path.isdir(path):
        raise Stop(f'{what} {path} is a directory; pass the path of a UTF-8 text file in it')
    if not os.path.isfile(path):  # /dev/null, a FIFO, a socket: nothing to read a text from twice
        raise Stop(f'{what} {path} is not a regular file (a device, a FIFO or a socket); pass the path of a UTF-8 '
                   f'text file')
    return path


def data_sources(cfg):
    """(source paths, train and val chunk factories, cache name) of the configured text: data_file, or
    wiki.test.raw alone (dataset=wikitext103-test, split as a data_file), or WikiText-103's train and valid."""
    if cfg['data_file'] or cfg['dataset'] == 'wikitext103-test':
        if cfg['data_file']:
            path = text_file(cfg['data_file'], 'data_file')
        else:
            path = os.path.join(cfg['data_dir'], 'wiki.test.raw')
            if not os.path.isfile(path):
                download_wikitext(cfg, ['wiki.test.raw'])

        @functools.lru_cache(maxsize=1)
        def split():  # read only when the cache has to be built, and then once
            text = read_utf8(path, 'the text')
            cut = int(0.9 * len(text))
            return text[:cut], text[cut:]
        return [path], lambda: [split()[0]], lambda: [split()[1]], os.path.basename(path)
    if not all(os.path.isfile(os.path.join(cfg['data_dir'], n)) for n in WIKITEXT[:2]):
        download_wikitext(cfg, list(WIKITEXT[:2]))
    sources = [text_file(os.path.join(cfg['data_dir'], n), 'the text') for n in WIKITEXT[:2]]
    return sources, lambda: text_chunks(sources[0]), lambda: text_chunks(sources[1]), 'wikitext103'


def prepare_data(cfg):
    """Encoded train/val memmaps and meta, built once per source into the cache and reused."""
    sources, train_chunks, val_chunks, name = data_sources(cfg)
    if os.path.isdir(cache_root(cfg)):
        remove_stale_builds(cache_root(cfg))
    where = hashlib.sha1(json.dumps([os.path.abspath(p) for p in sources]).encode()).hexdigest()[:16]
    digest = digest_of(sources, os.path.join(cache_root(cfg), '.sources', f'{where}.json'))
    key = f"{name}-{digest[:16]}-min{cfg['min_char_count']}-enc{ENCODER_VERSION}"
    folder = os.path.join(cache_root(cfg), key)
    if not os.path.isfile(os.path.join(folder, 'meta.json')):
        build_cache(folder, train_chunks, val_chunks, cfg,
                    dict(source=[os.path.abspath(p) for p in sources], sha256=digest))
    train, val, meta = load_cache(folder, digest)
    meta['cache_key'] = key
    if len(train) < 2 * cfg['block_size'] + 2 or len(val) < cfg['block_size'] + 2:
        raise Stop(f"{', '.join(sources)}: {len(train)} training and {len(val)} validation characters, "
                   f"too short for block_size={cfg['block_size']} (the 10% validation part needs more than "
                   f"block_size); use a longer text or a smaller --block_size")
    return train, val, meta


def build_cache(folder, train_chunks, val_chunks, cfg, source):
    """Encode into a .building-HOST-PID-* folder, then rename it into place: a cache is complete or absent.
    The temporary folder goes on any failure or signal; one left by a killed process goes at the next start."""
    root = cache_root(cfg)
    with writing(root, 'pass another --cache_dir'):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f'.building-{socket.gethostname()}-{os.getpid()}-', dir=root)
    t0 = time.time()
    try:
        meta = encode_dataset(train_chunks, val_chunks, cfg['min_char_count'], tmp, source)
        os.rename(tmp, folder)
    except OSError as e:
        if not os.path.isfile(os.path.join(folder, 'meta.json')):  # else another process finished it first
            raise disk_error(folder, e, 'pass another --cache_dir') from None
        return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"encoded {meta['n_train'] + meta['n_val']:,} characters in {time.time() - t0:.1f}s into {folder}")


def remove_stale_builds(root):
    """.building-HOST-PID-* folders of dead processes: on this host when the PID is gone, else after a day."""
    for name in os.listdir(root):
        if not name.startswith('.building-'):
            continue
        host, _, pid = name[len('.building-'):].rpartition('-')[0].rpartition('-')
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            if host == socket.gethostname() and pid.isdigit():
                stale = not pid_alive(int(pid))
            else:  # another host's (a shared cache): its PID means nothing here
                stale = time.time() - os.path.getmtime(path) > 86400
            if stale:
                shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno != errno.ESRCH  # EPERM: someone else's process
    return True


def load_cache(folder, digest):
    """The cache's memmaps and meta, checked: built from this text, of the recorded lengths and checksums."""
    try:
        with open(os.path.join(folder, 'meta.json')) as f:
            meta = json.load(f)
        ok = meta['sha256'] == digest and meta['encoder_version'] == ENCODER_VERSION and [
            os.path.getsize(os.path.join(folder, n)) for n in BINS] == [2 * meta['n_train'], 2 * meta['n_val']]
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise Stop(f'the data cache {folder} is corrupt or was built from a different file; '
                   f'delete that folder and run again to rebuild it')
    verify_checksums(folder, meta)
    train, val = (np.memmap(os.path.join(folder, n), dtype=np.uint16, mode='r') if meta[f'n_{n[:-4]}'] else
                  np.zeros(0, dtype=np.uint16) for n in BINS)  # numpy cannot map an empty file
    return train, val, meta


def verify_checksums(folder, meta):
    """train.bin and val.bin against the SHA-256 in meta.json (hashed again only when a file changed)."""
    for name in BINS:
        if digest_of([os.path.join(folder, name)], memo_of(folder, name)) != meta[f'{name[:-4]}_sha256']:
            raise Stop(f'the data cache {folder}: {name} does not match its checksum in meta.json (it changed '
                             f'after it was built); delete that folder and run again to rebuild it')
