"""
Train a small character-level GPT on WikiText-103 and log the geometry of its queries and keys.

    python train.py --n_layer=4 --seed=1                                # one GPU, CPU or MPS
    python train.py --data_file=my_text.txt --n_embd=128 --n_head=4     # any UTF-8 text instead
    python train.py my_config.py --seed=2                               # a config file, then overrides
    torchrun --nproc_per_node=4 train.py --n_layer=8 --grad_accum=4     # several GPUs (DDP)

Each run writes out_dir/run_name/; the same command again resumes it (Ctrl-C checkpoints first), --overwrite=True
starts it over. configurator.py, prepare.py and runfolder.py hold the plumbing, which a research change never needs.
"""
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing import configurator
import control as spectrum_control  # "control" is also a config key
import geometry
from plumbing import prepare
from plumbing import runfolder

# -----------------------------------------------------------------------------
# config: module globals, overridden by config files and then --key=value; every setting, its default and meaning
# I/O
out_dir = 'out'            # runs go to out_dir/run_name/
run_name = ''              # '' = from the settings: L4_normal_s1, L4_normal_shrink0.2-k_s1, plus a hash of the rest
overwrite = False          # start over even if the run folder holds a finished or partial run
eval_interval = 250        # estimate train/val loss (and log a record) every this many iterations
eval_iters = 20            # batches per loss estimate
geom_interval = 250        # measure Q/K geometry every this many iterations (0 = geometry logging off)
eval_windows = 16          # validation windows of the fixed evaluation batch (entropy, token-level PR)
ckpt_interval = 500        # write ckpt.pt every this many iterations (and at the end)
model_ckpts = 8            # model-weight checkpoints at log-spaced iterations, for token-level analysis
save_snapshots = True      # write W_Q/W_K (float32) at every geometry record to snapshots/
# data
dataset = 'wikitext103'    # when data_file is empty: wikitext103 | wikitext103-test (wiki.test.raw split 90/10)
data_dir = 'data/wikitext-103-raw'  # where wiki.{train,valid,test}.raw are, or are downloaded to
data_file = ''             # any UTF-8 text file instead: first 90% train, last 10% validation
data_url = 'https://wikitext.smerity.com/wikitext-103-raw-v1.zip'  # where WikiText-103 is downloaded from
cache_dir = ''             # encoded datasets; '' = $QKGEOM_CACHE or ~/.cache/qkgeom
min_char_count = 10        # rarer training characters share one unknown id
# model
n_layer = 4                # transformer blocks
n_head = 6                 # attention heads per block (n_embd must divide by it)
n_embd = 384               # width C: W_Q and W_K are (C, C)
block_size = 256           # context length in characters
dropout = 0.0              # dropout probability in training
qk_init = 'normal'         # normal | orthogonal | tied (see QK_INITS)
# optimizer
optimizer = 'adamw'        # adamw | sgd (with momentum); see OPTIMIZERS
batch_size = 64            # per micro-step; global batch = batch_size * grad_accum
grad_accum = 1             # micro-steps per iteration, split across DDP ranks
max_iters = 5000           # optimizer steps
lr = 1e-3                  # peak learning rate, after a linear warm-up
min_lr = 1e-4              # learning rate at the end of the cosine decay
warmup_iters = 100         # linear warm-up iterations
weight_decay = 0.1         # decoupled weight decay on matrices
decay_qk = True            # apply weight decay to W_Q and W_K too (it shrinks both spectra: a confound)
beta1 = 0.9                # AdamW beta1
beta2 = 0.99               # AdamW beta2
momentum = 0.9             # SGD momentum
grad_clip = 1.0            # clip the gradient norm to this; 0 = off
# key-spectrum control (control.py)
control = 'none'           # none | shrink | freeze
control_target = 'k'       # k: control W_K (the experiment); q: control W_Q (the mirror)
control_scope = 'head'     # head: each head's (d, C) block; layer: the whole (C, C) matrix
control_keep = 'fro'       # fro | spec: what reshaping keeps, the Frobenius norm or the top singular value
control_layers = ''        # comma-separated layer indices; '' = all layers
shrink_to = 0.5            # shrink: final target PR as a fraction of the step-0 PR
shrink_iters = 2000        # shrink: iterations over which the target falls linearly
control_interval = 1       # apply control every this many optimizer steps
# system
seed = 1                   # seeds the init, dropout and the data order
device = ''                # '' = cuda, then mps, then cpu
dtype = 'auto'             # auto (bfloat16 on CUDA where supported, else float32) | float32 | bfloat16
compile = False            # torch.compile the training forward (where available)
threads = 0                # CPU threads for torch; 0 = torch's default
config_keys = [k for k, v in list(globals().items())
               if not k.startswith('_') and isinstance(v, (bool, int, float, str))]
# what each setting must be, checked before anything is touched (configurator.check): its choices, or a condition on
# the settings; any other number, a fork's new setting too, must be finite. 0 is none or off where a count allows it
SETTINGS = {
    **{k: f'1 <= {k} <= 1e9' for k in ('n_layer', 'n_head', 'block_size', 'batch_size', 'grad_accum', 'eval_iters',
                                       'eval_windows', 'eval_interval', 'ckpt_interval', 'control_interval')},
    **{k: f'0 <= {k} <= 1e9' for k in ('max_iters', 'geom_interval', 'model_ckpts', 'warmup_iters', 'shrink_iters')},
    **{k: f'0 <= {k} < 1' for k in ('dropout', 'beta1', 'beta2', 'momentum')}, 'min_char_count': '1 <= min_char_count',
    'n_embd': '1 <= n_embd <= 1e9 and n_embd % n_head == 0', 'lr': '0 <= lr', 'min_lr': '0 <= min_lr <= lr',
    'weight_decay': '0 <= weight_decay and lr * weight_decay < 1',  # < 1: the share of a weight decayed per step
    'grad_clip': '0 <= grad_clip', 'shrink_to': '0 < shrink_to', 'seed': '0 <= seed < 2**32',
    'threads': '0 <= threads <= 1024', 'qk_init': 'qk_init in QK_INITS', 'optimizer': 'optimizer in OPTIMIZERS',
    'control': spectrum_control.KINDS, 'control_keep': spectrum_control.KEEPS, 'control_target': ('k', 'q'),
    'control_scope': ('head', 'layer'), 'dataset': ('wikitext103', 'wikitext103-test'),
    'control_layers': 'len(spectrum_control.parse_layers(control_layers, n_layer)) >= 1',  # '' is every layer
    'data_file': "data_file == '' or os.path.isfile(data_file)", 'dtype': ('auto', 'float32', 'bfloat16'),
}

# ----------------------------------------------------------------------------- batches

EVAL_SEED = 1234  # the evaluation windows are the same for every run, whatever its seed


def get_batch(data, idx, block_size, pin=False):
    """Inputs and next-character targets of the windows at idx; pinned for a non_blocking copy to a GPU."""
    x = np.stack([data[i:i + block_size] for i in idx.tolist()]).astype(np.int64)
    y = np.stack([data[i + 1:i + 1 + block_size] for i in idx.tolist()]).astype(np.int64)
    return tuple(t.pin_memory() if pin else t for t in (torch.from_numpy(x), torch.from_numpy(y)))


def random_offsets(data, shape, block_size, generator):
    return torch.randint(len(data) - block_size - 1, shape, generator=generator)


def eval_batch(val_data, cfg):
    """The evaluation batch of entropy and token-level PR, alike for every run."""
    gen = torch.Generator().manual_seed(EVAL_SEED)
    return get_batch(val_data, random_offsets(val_data, (cfg['eval_windows'],), cfg['block_size'], gen),
                     cfg['block_size'])


# ----------------------------------------------------------------------------- model

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        # separate q and k (not one fused c_attn) so W_Q and W_K are plain (C, C) weights to measure
        self.q = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.k = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.v = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.proj = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.n_head, self.dropout = c.n_head, c.dropout
        self.resid_drop = nn.Dropout(c.dropout)

    def forward(self, x, probe=None):
        B, T, C = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        split = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if probe is None:  # training: the fused kernel, probabilities never materialised
            y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # measuring: the same attention written out, so the probabilities can be kept
            logits = split(q) @ split(k).transpose(-2, -1) / math.sqrt(C // self.n_head)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = logits.masked_fill(~mask, float('-inf')).softmax(dim=-1)
            y = att @ split(v)
            probe.append((q.detach(), k.detach(), att.detach()))
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=False)
        self.proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=False)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd, bias=False)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.n_embd, bias=False)
        self.mlp = MLP(c)

    def forward(self, x, probe=None):
        x = x + self.attn(self.ln1(x), probe)
        return x + self.mlp(self.ln2(x))


QK_INITS = {  # name -> the init of a layer's (W_Q, W_K), in place
    'normal': lambda wq, wk: [nn.init.normal_(w, std=0.02) for w in (wq, wk)],
    # E||W||_F^2 of N(0, 0.02^2) entries is C^2 * 0.02^2; an orthogonal matrix has ||W||_F^2 = C
    'orthogonal': lambda wq, wk: [nn.init.orthogonal_(w).mul_(0.02 * math.sqrt(w.shape[0])) for w in (wq, wk)],
    'tied': lambda wq, wk: wk.copy_(nn.init.normal_(wq, std=0.02)),
}


class GPT(nn.Module):
    def __init__(self, c, qk_init='normal'):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd, bias=False)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        for name, p in self.named_parameters():  # matrices (not LayerNorm gains); residual projections scaled
            if p.dim() == 2:                        # down with depth, as in GPT-2
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.n_layer) if name.endswith('proj.weight') else 0.02)
        with torch.no_grad():
            for block in self.blocks:
                QK_INITS[qk_init](block.attn.q.weight, block.attn.k.weight)

    def forward(self, idx, targets=None, probe=None):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x, probe)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def qk_weights(self):
        """W_Q and W_K of every layer: the objects of the study."""
        return [(b.attn.q.weight, b.attn.k.weight) for b in self.blocks]


# ----------------------------------------------------------------------------- optimizer and schedules

OPTIMIZERS = {  # name -> the optimizer of the parameter groups (torch's SGD adds the decay to the gradient)
    'adamw': lambda groups, cfg, dev_type: torch.optim.AdamW(groups, lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']),
                                                             fused=dev_type == 'cuda'),
    'sgd': lambda groups, cfg, dev_type: torch.optim.SGD(groups, lr=cfg['lr'], momentum=cfg['momentum']),
}


def make_optimizer(model, cfg, dev_type):
    """Weight decay on matrices (not gains), and on W_Q and W_K only with decay_qk."""
    qk_ids = {id(w) for pair in model.qk_weights() for w in pair}
    decays = lambda p: p.dim() >= 2 and (cfg['decay_qk'] or id(p) not in qk_ids)
    groups = [{'params': [p for p in model.parameters() if decays(p)], 'weight_decay': cfg['weight_decay']},
              {'params': [p for p in model.parameters() if not decays(p)], 'weight_decay': 0.0}]
    return OPTIMIZERS[cfg['optimizer']](groups, cfg, dev_type)


def get_lr(it, cfg):
    """Linear warm-up, then cosine decay to min_lr at max_iters."""
    if it < cfg['warmup_iters']:
        return cfg['lr'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it >= cfg['max_iters']:
        return cfg['min_lr']
    ratio = (it - cfg['warmup_iters']) / (cfg['max_iters'] - cfg['warmup_iters'])  # > 0 here
    return cfg['min_lr'] + 0.5 * (1 + math.cos(math.pi * ratio)) * (cfg['lr'] - cfg['min_lr'])


def loss_iters(cfg):
    """Iterations whose record has train_loss and val_loss (with geometry off, also the model checkpoints')."""
    m = cfg['max_iters']
    its = {0, m} | set(range(0, m + 1, cfg['eval_interval']))
    return its if cfg['geom_interval'] else its | geometry.model_ckpt_iters(cfg)


def log_iters(cfg):
    """The loss iterations; with geometry on, 1, 2, 4, ... (the fast early change), each geom_interval, model_ckpts."""
    m, g = cfg['max_iters'], cfg['geom_interval']
    its = loss_iters(cfg) | geometry.model_ckpt_iters(cfg)
    if g:
        its |= set(range(0, m + 1, g)) | {2 ** i for i in range(int(math.log2(g)) + 1) if 2 ** i <= m}
    return its


# =============================================================================
# RESEARCH: what each record measures (a new metric: measure_geometry, its math in geometry.py), and the
# key-spectrum control (a new intervention: where control_step calls control.py).
# =============================================================================

@torch.no_grad()
def estimate_loss(model, data, cfg, dev, ctx):
    """Mean loss over eval_iters batches from a fixed generator: the same windows for every run and record."""
    model.eval()
    g = torch.Generator().manual_seed(EVAL_SEED)
    out = {}
    for split, arr in data.items():
        losses = []
        for _ in range(cfg['eval_iters']):
            x, y = get_batch(arr, random_offsets(arr, (cfg['batch_size'],), cfg['block_size'], g), cfg['block_size'])
            with ctx:
                losses.append(model(x.to(dev), y.to(dev))[1])
        out[split] = float(np.mean(torch.stack(losses).tolist()))   # one copy to the host per split
    model.train()
    return out


@torch.no_grad()
def measure_geometry(model, eval_x, eval_y, n_head, w0):
    """The evaluation batch's loss and every metric of geometry.py per layer (None: not finite), in one host copy."""
    model.eval()
    probe = []
    loss = model(eval_x, eval_y, probe=probe)[1]  # float32, explicit attention
    model.train()
    return geometry.record(model.qk_weights(), w0, probe, loss, n_head)


def measure(run, it):
    """One metrics.jsonl record: the losses (at loss iterations), the geometry of every layer, the control's PRs."""
    row = {'iter': it, 'tokens': it * run.cfg['batch_size'] * run.cfg['grad_accum'] * run.cfg['block_size'],
           'lr': get_lr(it, run.cfg)}
    if it in loss_iters(run.cfg):
        losses = estimate_loss(run.model, run.data, run.cfg, run.dev, run.ctx)
        row.update(train_loss=losses['train'], val_loss=losses['val'])
    t0 = time.time()
    if run.cfg['geom_interval']:
        loss, layers = measure_geometry(run.model, *run.eval_batch, run.cfg['n_head'], run.w0)
        if layers is None:
            nan_stop('the evaluation batch gave a loss or activations that are not finite', it, run)
        for layer, ctl_row in zip(layers, spectrum_control.report(run.ctl)):
            layer.update(ctl_row)
        row['eval_loss'], row['layers'] = loss, layers
    run.t_geom += time.time() - t0
    return row


def control_step(run, step):
    """The causal experiment: reshape the controlled spectra after optimizer step number `step`."""
    if run.cfg['control'] == 'none':
        return
    sync = getattr(torch, run.dev.split(':')[0]).synchronize   # the queued backward and step are not control time
    t0 = sync() or time.time()
    spectrum_control.apply(run.ctl, run.cfg, run.model.qk_weights(), step)
    run.t_ctl += (sync() or time.time()) - t0


# ----------------------------------------------------------------------------- the run

@dataclass
class Run:
    """What one training process holds: built by setup(), advanced by the loop, written by the writers."""
    cfg: dict                     # the settings (get_config)
    ddp: bool                     # under torchrun (runfolder.start): process `rank` of `world`, on dev
    rank: int
    world: int
    dev: str                      # cpu, cuda, cuda:1, mps
    dir: str = ''                 # out_dir/run_name
    lock: object = None           # dir/.lock, held while this process trains there (rank 0)
    meta: dict = None             # the encoded text (prepare.py): vocab_size, chars, sha256, cache_key, n_train, n_val
    data: dict = None             # 'train', 'val': the encoded text, uint16 memmaps
    data_gen: torch.Generator = field(default_factory=torch.Generator)  # the windows' order, seeded each step
    eval_batch: tuple = ()        # the fixed evaluation windows (x, y) on dev, alike for every run
    model: GPT = None
    train_model: nn.Module = None  # the model as a training step calls it: compiled, DDP-wrapped where asked
    optimizer: torch.optim.Optimizer = None
    ctl: dict = None              # the control's state: the step-0 spectra it steers from (control.py)
    w0: torch.Tensor = None       # every layer's W_Q, W_K at step 0, (n_layer, 2, C, C): the learned part is W - w0
    dtype: str = 'float32'        # the autocast dtype and CPU threads (set_numerics): a resumed run keeps ckpt.pt's
    threads: int = 1
    ctx: object = contextlib.nullcontext()  # autocast to dtype, or nothing
    start: int = 0                # this process's first iteration: 0, or the one ckpt.pt holds
    saved_at: int = None          # the iteration ckpt.pt holds
    elapsed: float = 0.0          # wall seconds of the run's earlier processes
    metrics: object = None        # metrics.jsonl, open to append (rank 0)
    losses: list = field(default_factory=list)  # (iteration, training loss on dev) the host has not read
    last: dict = field(default_factory=dict)    # the latest record, for done.json
    t_start: float = 0.0          # when this process's loop began
    t_geom: float = 0.0           # seconds measuring geometry and writing snapshots and model checkpoints
    t_ctl: float = 0.0            # seconds in the control
    mark: tuple = (0.0, 0)        # (time, iteration) from which ms/iter and the time left count: training only
    master = property(lambda self: self.rank == 0)
    ckpt_path = property(lambda self: os.path.join(self.dir, 'ckpt.pt'))


def train(cfg):
    """One run from its config: trains, logs, checkpoints; resumes an unfinished run. Returns the run folder."""
    run = Run(cfg, *runfolder.start(cfg['device']))
    with runfolder.held(run):  # out of memory or of disk space is one line; no .lock is left behind
        setup(run)
        loop(run)
        finish(run)
    return run.dir


def setup(run):
    """Seeds and numerics; the data; the run folder locked; the model, optimizer and a first batch built. Only then
    is the folder started over or trimmed to ckpt.pt: a check or an allocation that fails leaves it as it was."""
    cfg, dev_type = run.cfg, run.dev.split(':')[0]
    if cfg['grad_accum'] % run.world:
        raise configurator.Stop(f"grad_accum={cfg['grad_accum']} must be divisible by the {run.world} DDP processes")
    torch.manual_seed(cfg['seed'])  # the init, alike on every DDP rank; each step seeds its own draws
    use_bf16 = cfg['dtype'] == 'bfloat16' or (cfg['dtype'] == 'auto' and dev_type == 'cuda'
                                               and torch.cuda.is_bf16_supported())
    runfolder.set_numerics(run, 'bfloat16' if use_bf16 else 'float32', cfg['threads'] or torch.get_num_threads())
    run.dir, run.lock = runfolder.claim(cfg, run.master)
    train_data, val_data, run.meta = prepare.prepare_data(cfg)  # one process encodes a text; the others wait
    run.data = {'train': train_data, 'val': val_data}
    resuming = os.path.exists(run.ckpt_path) and not cfg['overwrite']
    run.eval_batch = tuple(t.to(run.dev) for t in eval_batch(val_data, cfg))
    build_model(run, dev_type, resuming)
    if run.master:
        runfolder.begin(run, resuming)
    run.train_model = torch.compile(run.model) if cfg['compile'] and dev_type != 'mps' else run.model
    if run.ddp:  # on CUDA, the device start() made current
        run.train_model = nn.parallel.DistributedDataParallel(run.train_model)


def build_model(run, dev_type, resuming):
    """The model, optimizer and control state, the checkpoint over them when resuming; then one micro-batch forward and
    back, so that memory the run cannot have fails before the run folder is touched."""
    cfg = run.cfg
    run.model = GPT(GPTConfig(run.meta['vocab_size'], cfg['block_size'], cfg['n_layer'], cfg['n_head'], cfg['n_embd'],
                              cfg['dropout']), cfg['qk_init']).to(run.dev)
    run.optimizer = make_optimizer(run.model, cfg, dev_type)
    run.ctl = spectrum_control.record(cfg, run.model.qk_weights())
    run.w0 = torch.stack([torch.stack(pair) for pair in run.model.qk_weights()]).detach()
    if resuming:
        ckpt = runfolder.load_checkpoint(run.ckpt_path, cfg, run.meta, run.model, run.optimizer)
        run.start = run.saved_at = ckpt['iter']
        run.elapsed, run.ctl, run.w0 = ckpt['elapsed'], ckpt['control'], ckpt['w0'].to(run.dev)
        if ckpt['numerics'] != {'dtype': run.dtype, 'threads': run.threads}:  # either changes the numbers
            print('resuming in {dtype} on {threads} threads as ckpt.pt was trained'.format(**ckpt['numerics']))
            runfolder.set_numerics(run, **ckpt['numerics'])
    with run.ctx:
        x, y = get_batch(run.data['train'], torch.zeros(cfg['batch_size'], dtype=int), cfg['block_size'])
        run.model(x.to(run.dev), y.to(run.dev))[1].backward()
    run.optimizer.zero_grad(set_to_none=True)


def loop(run):
    """A record at the logged iterations, an optimizer step, the control; ckpt.pt every ckpt_interval, on a signal."""
    cfg, logs = run.cfg, log_iters(run.cfg)
    run.t_start, run.mark = time.time(), (time.time(), run.start)
    caught = []  # Ctrl-C or SIGTERM (a Slurm time limit), acted on between two iterations; a second one as usual
    catch = lambda num, frame: caught.append(num) or signal.signal(num, handlers[num])
    handlers = {s: signal.signal(s, catch) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for it in range(run.start, cfg['max_iters'] + 1):
            ckpt_due = it > run.start and it % cfg['ckpt_interval'] == 0
            stop = caught and not run.ddp
            if it in logs or ckpt_due:  # DDP ranks read their losses (and a signal) together here only
                stop = check_losses(run, len(caught))
            if stop:
                checkpoint(run, it)
                sys.exit(f'stopped at iteration {it}: ckpt.pt holds it, and the same command resumes from there')
            if run.master and it in logs:
                record(run, it)
            if it == cfg['max_iters']:
                break
            if ckpt_due:
                checkpoint(run, it)
            train_step(run, it)
            control_step(run, it + 1)
            if run.master and it + 1 == run.start + 5 < cfg['max_iters']:  # a CPU can take hours: say so now
                left = (time.time() - run.mark[0]) / (it + 1 - run.mark[1]) * (cfg['max_iters'] - it - 1)
                print(f'about {runfolder.fmt_time(left)} to go on {run.dev}, evaluations aside', flush=True)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def train_step(run, it):
    """One optimizer step over grad_accum micro-batches (this rank's share); its loss stays on the device."""
    cfg, micro = run.cfg, run.cfg['grad_accum'] // run.world
    for group in run.optimizer.param_groups:
        group['lr'] = get_lr(it, cfg)
    runfolder.seed_all(cfg['seed'], run.rank, it, run.data_gen)  # as drawn uninterrupted
    # every rank draws the whole global batch's offsets, so the data stream does not depend on world
    offsets = random_offsets(run.data['train'], (cfg['grad_accum'], cfg['batch_size']), cfg['block_size'],
                             run.data_gen)
    step_loss = 0.0
    for m in range(micro):
        x, y = get_batch(run.data['train'], offsets[run.rank * micro + m], cfg['block_size'], 'cuda' in run.dev)
        if run.ddp:
            run.train_model.require_backward_grad_sync = m == micro - 1
        with run.ctx:
            loss = run.train_model(x.to(run.dev, non_blocking=True), y.to(run.dev, non_blocking=True))[1] / micro
        loss.backward()
        step_loss = step_loss + loss.detach().float()
    run.losses.append((it, step_loss))
    if cfg['grad_clip']:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg['grad_clip'])
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def check_losses(run, caught):
    """One host read of the losses since the last (one not finite stops all DDP ranks); whether a rank got a signal."""
    values = torch.stack([loss for _, loss in run.losses] + [torch.tensor(float(caught), device=run.dev)])
    if run.ddp:
        torch.distributed.all_reduce(values)
    *losses, signals = values.tolist()
    for (step, _), loss in zip(run.losses, losses):
        if not math.isfinite(loss):
            nan_stop(f'the loss became {loss}', step, run)
    run.losses = []
    return signals > 0


def nan_stop(what, it, run):
    kept = f'ckpt.pt holds iteration {run.saved_at}' if run.saved_at is not None else 'no ckpt.pt yet'
    raise configurator.Stop(f"{what} at iteration {it}; the run stops ({kept}). Lower --lr (now {run.cfg['lr']}) "
                            f"or lengthen --warmup_iters, then rerun with --overwrite=True")


# ----------------------------------------------------------------------------- what the run writes

def record(run, it):
    """Measure (RESEARCH above), then write: the snapshot and model checkpoint of the iteration, if any, the record."""
    ms = 1000 * (time.time() - run.mark[0]) / (it - run.mark[1]) if it > run.mark[1] else None
    row = measure(run, it)
    runfolder.save_weights(run, it, it in geometry.model_ckpt_iters(run.cfg))  # geometry's time
    row['time'] = run.elapsed + time.time() - run.t_start
    print(runfolder.log_line(row), file=run.metrics, flush=True)
    run.last = row
    runfolder.print_record(row, ms, run)
    run.mark = (time.time(), it)  # time spent measuring is not training time


def checkpoint(run, it):
    """ckpt.pt: everything that decides the rest of the run, never of weights that are not finite."""
    if not torch.stack([torch.isfinite(p).all() for p in run.model.parameters()]).all():
        nan_stop('the weights are no longer finite', it, run)
    if run.master:
        runfolder.atomic_save({'model': run.model.state_dict(), 'optimizer': run.optimizer.state_dict(), 'iter': it,
                               'elapsed': run.elapsed + time.time() - run.t_start, 'config': run.cfg, 'w0': run.w0,
                               'control': run.ctl, 'data_sha256': run.meta['sha256'],
                               'numerics': {'dtype': run.dtype, 'threads': run.threads}}, run.ckpt_path)
        run.saved_at = it


def finish(run):
    """The final checkpoint, then done.json, a sweep's sign of a complete run."""
    checkpoint(run, run.cfg['max_iters'])
    run.elapsed += time.time() - run.t_start
    if run.master:
        run.metrics.close()
        done = {k: run.last.get(k) for k in ('iter', 'train_loss', 'val_loss')}
        for key in ('pr_q', 'pr_k', 'pr_qk', 'entropy', 'entropy_norm') if run.last.get('layers') else ():
            done[key] = float(np.mean([layer[key] for layer in run.last['layers']]))
        share = lambda t: t / max(time.time() - run.t_start, 1e-9)
        done.update(wall_time=run.elapsed, geometry_share=share(run.t_geom), control_share=share(run.t_ctl))
        runfolder.atomic_save(json.dumps(done, indent=1).encode(), os.path.join(run.dir, 'done.json'))
        print(f"done in {runfolder.fmt_time(run.elapsed)}: val loss {done['val_loss']:.4f}; geometry logging took "
              f"{100 * done['geometry_share']:.1f}% of wall time; run folder {run.dir}", flush=True)
    if run.ddp:
        torch.distributed.barrier()  # every rank got here: rank 0 has finished writing


# ----------------------------------------------------------------------------- main

def get_config(argv):
    """The config block above, then config files, then --key=value (configurator.py), checked against SETTINGS."""
    return configurator.get_config(argv, {k: globals()[k] for k in config_keys}, SETTINGS, globals())


def main(argv):
    """train.py [CONFIG_FILE ...] [--key=value ...]"""
    try:
        train(get_config(argv))
    except configurator.Stop as e:
        print(f'error: {e.code}', file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == '__main__':
    main(sys.argv[1:])
