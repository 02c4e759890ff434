"""
Train a small character-level GPT on WikiText-103 and log the geometry of its queries and keys.

    python train.py --n_layer=4 --seed=1                             # one GPU, CPU or MPS
    python train.py --data_file=my_text.txt --n_embd=128 --n_head=4  # any UTF-8 text instead
    python train.py my_config.py --seed=2                            # a config file, then overrides
    torchrun --nproc_per_node=4 train.py --n_layer=8 --grad_accum=4  # several GPUs (DDP)

Each run writes out_dir/run_name/; the same command resumes it (Ctrl-C checkpoints first), and
--overwrite=True starts it over. plumbing/ holds what a research change never needs.
"""
import contextlib
import math
import os
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
# config: module globals, overridden by config files, then by --key=value; each with its meaning
# I/O
out_dir = 'out'            # runs go to out_dir/run_name/
run_name = ''              # '' = from the settings: L4_normal_s1, then a hash of the rest
overwrite = False          # start over even if the run folder holds a finished or partial run
eval_interval = 250        # estimate train/val loss (and log a record) every this many iterations
eval_iters = 20            # batches per loss estimate
geom_interval = 250        # measure Q/K geometry every this many iterations (0 = off)
eval_windows = 16          # windows of the fixed evaluation batch (entropy, token-level PR)
ckpt_interval = 500        # write ckpt.pt every this many iterations (and at the end)
model_ckpts = 8            # model checkpoints at log-spaced iterations, for token-level analysis
save_snapshots = True      # write W_Q/W_K (float32) at every geometry record to snapshots/
# logging to Weights & Biases (optional: pip install wandb)
wandb_log = False          # send the config and each record's losses and geometry to wandb (rank 0)
wandb_project = 'qkgeom'   # the wandb project
wandb_run_name = ''        # the wandb run's name; '' = run_name
# data
dataset = 'wikitext103'    # no data_file: wikitext103 | wikitext103-test (wiki.test.raw, 90/10)
data_dir = 'data/wikitext-103-raw'  # where wiki.{train,valid,test}.raw are, or are downloaded to
data_file = ''             # any UTF-8 text file instead: first 90% train, last 10% validation
data_url = 'https://wikitext.smerity.com/wikitext-103-raw-v1.zip'  # WikiText-103's download
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
decay_qk = True            # weight decay on W_Q and W_K too (it shrinks both spectra: a confound)
beta1 = 0.9                # AdamW beta1
beta2 = 0.99               # AdamW beta2
momentum = 0.9             # SGD momentum
grad_clip = 1.0            # clip the gradient norm to this; 0 = off
# key-spectrum control (control.py)
control = 'none'           # none | shrink | freeze
control_target = 'k'       # k: control W_K (the experiment); q: control W_Q (the mirror)
control_scope = 'head'     # head: each head's (d, C) block; layer: the whole (C, C) matrix
control_keep = 'fro'       # fro | spec: reshaping keeps the Frobenius norm | the top singular value
control_layers = ''        # comma-separated layer indices; '' = all layers
shrink_to = 0.5            # shrink: final target PR as a fraction of the step-0 PR
shrink_iters = 2000        # shrink: iterations over which the target falls linearly
control_interval = 1       # apply control every this many optimizer steps
# system
seed = 1                   # seeds the init, dropout and the data order
device = ''                # '' = cuda, then mps, then cpu
dtype = 'auto'             # auto (bfloat16 if CUDA supports it, else float32) | float32 | bfloat16
compile = False            # torch.compile the training forward (where available)
threads = 0                # CPU threads for torch; 0 = torch's default
config_keys = [k for k, v in list(globals().items())
               if not k.startswith('_') and isinstance(v, (bool, int, float, str))]
# What each setting must be, checked before anything is touched (configurator.check):
# its choices, or a condition on the settings. 0 is none or off where a count allows it.
# Any other number, a fork's new setting too, must be finite.
SETTINGS = {
    **{k: f'1 <= {k} <= 1e9' for k in ('n_layer', 'n_head', 'block_size', 'batch_size',
                                       'grad_accum', 'eval_iters', 'eval_windows', 'eval_interval',
                                       'ckpt_interval', 'control_interval')},
    **{k: f'0 <= {k} <= 1e9'
       for k in ('max_iters', 'geom_interval', 'model_ckpts', 'warmup_iters', 'shrink_iters')},
    **{k: f'0 <= {k} < 1' for k in ('dropout', 'beta1', 'beta2', 'momentum')},
    'min_char_count': '1 <= min_char_count', 'seed': '0 <= seed < 2**32',
    'n_embd': '1 <= n_embd <= 1e9 and n_embd % n_head == 0',
    'lr': '0 <= lr', 'min_lr': '0 <= min_lr <= lr', 'grad_clip': '0 <= grad_clip',
    'weight_decay': '0 <= weight_decay and lr * weight_decay < 1',  # < 1: the share decayed a step
    'shrink_to': '0 < shrink_to', 'threads': '0 <= threads <= 1024',
    'qk_init': 'qk_init in QK_INITS', 'optimizer': 'optimizer in OPTIMIZERS',
    'control': spectrum_control.KINDS, 'control_keep': spectrum_control.KEEPS,
    'control_target': ('k', 'q'),
    'control_scope': ('head', 'layer'), 'dataset': ('wikitext103', 'wikitext103-test'),
    # '' is every layer
    'control_layers': 'len(spectrum_control.parse_layers(control_layers, n_layer)) >= 1',
    'data_file': "data_file == '' or os.path.isfile(data_file)",
    'dtype': ('auto', 'float32', 'bfloat16'),
}

# ------------------------------------------------------------------------------------------ batches

EVAL_SEED = 1234  # the evaluation windows are the same for every run, whatever its seed


def get_batch(data, offsets, block_size, pin=False):
    """The windows at offsets and their next characters (pinned: for a non_blocking copy)."""
    x = np.stack([data[i:i + block_size] for i in offsets.tolist()]).astype(np.int64)
    y = np.stack([data[i + 1:i + 1 + block_size] for i in offsets.tolist()]).astype(np.int64)
    return tuple(t.pin_memory() if pin else t for t in (torch.from_numpy(x), torch.from_numpy(y)))


def random_offsets(data, shape, block_size, generator):
    return torch.randint(len(data) - block_size - 1, shape, generator=generator)


def eval_batch(val_data, cfg):
    """The evaluation batch of entropy and token-level PR, alike for every run."""
    generator = torch.Generator().manual_seed(EVAL_SEED)
    offsets = random_offsets(val_data, (cfg['eval_windows'],), cfg['block_size'], generator)
    return get_batch(val_data, offsets, cfg['block_size'])


# -------------------------------------------------------------------------------------------- model

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        # separate q and k (not one fused c_attn) so W_Q and W_K are plain (C, C) weights to measure
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.n_head, self.dropout = config.n_head, config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x, probe=None):
        B, T, C = x.shape
        d = C // self.n_head  # the head size
        q, k, v = self.q(x), self.k(x), self.v(x)
        qh, kh, vh = [t.view(B, T, self.n_head, d).transpose(1, 2) for t in (q, k, v)]
        if probe is None:  # training: the fused kernel, the probabilities never materialised
            y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # measuring: the same attention written out, so that the probabilities can be kept
            logits = qh @ kh.transpose(-2, -1) / math.sqrt(d)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            probs = logits.masked_fill(~mask, float('-inf')).softmax(dim=-1)
            y = probs @ vh
            probe.append((q.detach(), k.detach(), probs.detach()))
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=False)
        self.mlp = MLP(config)

    def forward(self, x, probe=None):
        x = x + self.attn(self.ln1(x), probe)
        return x + self.mlp(self.ln2(x))


QK_INITS = {  # name -> the init of a layer's (W_Q, W_K), in place
    'normal': lambda wq, wk: [nn.init.normal_(w, std=0.02) for w in (wq, wk)],
    # E||W||_F^2 of N(0, 0.02^2) entries is C^2 * 0.02^2; an orthogonal matrix has ||W||_F^2 = C
    'orthogonal': lambda wq, wk: [nn.init.orthogonal_(w).mul_(0.02 * math.sqrt(w.shape[0]))
                                  for w in (wq, wk)],
    'tied': lambda wq, wk: wk.copy_(nn.init.normal_(wq, std=0.02)),
}


class GPT(nn.Module):
    def __init__(self, config, qk_init='normal'):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        # GPT-2's: residual projections scaled down, so the residual stream grows less with depth
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # matrices, not LayerNorm gains
                nn.init.normal_(p, std=residual_std if name.endswith('proj.weight') else 0.02)
        with torch.no_grad():
            for block in self.blocks:
                QK_INITS[qk_init](block.attn.q.weight, block.attn.k.weight)

    def forward(self, idx, targets=None, probe=None):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x, probe)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def qk_weights(self):
        """W_Q and W_K of every layer: the objects of the study."""
        return [(b.attn.q.weight, b.attn.k.weight) for b in self.blocks]


# -------------------------------------------------------------------------- optimizer and schedules

OPTIMIZERS = {  # name -> the optimizer of the parameter groups (SGD adds the decay to the gradient)
    'adamw': lambda groups, cfg, device_type: torch.optim.AdamW(
        groups, lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']), fused=device_type == 'cuda'),
    'sgd': lambda groups, cfg, device_type: torch.optim.SGD(
        groups, lr=cfg['lr'], momentum=cfg['momentum']),
}


def make_optimizer(model, cfg, device_type):
    """Weight decay on matrices (not gains), and on W_Q and W_K only with decay_qk."""
    spared = set() if cfg['decay_qk'] else {id(w) for pair in model.qk_weights() for w in pair}
    decayed = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in spared]
    rest = [p for p in model.parameters() if p.dim() < 2 or id(p) in spared]
    groups = [{'params': decayed, 'weight_decay': cfg['weight_decay']},
              {'params': rest, 'weight_decay': 0.0}]
    return OPTIMIZERS[cfg['optimizer']](groups, cfg, device_type)


def get_lr(it, cfg):
    """Linear warm-up, then cosine decay to min_lr at max_iters."""
    if it < cfg['warmup_iters']:
        return cfg['lr'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it >= cfg['max_iters']:
        return cfg['min_lr']
    ratio = (it - cfg['warmup_iters']) / (cfg['max_iters'] - cfg['warmup_iters'])  # > 0 here
    return cfg['min_lr'] + 0.5 * (1 + math.cos(math.pi * ratio)) * (cfg['lr'] - cfg['min_lr'])


def loss_iters(cfg):
    """Iterations with train_loss and val_loss (with geometry off, the model checkpoints' too)."""
    last = cfg['max_iters']
    iters = {0, last} | set(range(0, last + 1, cfg['eval_interval']))
    return iters if cfg['geom_interval'] else iters | geometry.model_ckpt_iters(cfg)


def log_iters(cfg):
    """The loss and model checkpoint iterations; with geometry on, each geom_interval too,
    and 1, 2, 4, ... for the fast early change."""
    last, every = cfg['max_iters'], cfg['geom_interval']
    iters = loss_iters(cfg) | geometry.model_ckpt_iters(cfg)
    if every:
        doublings = {2 ** i for i in range(int(math.log2(every)) + 1) if 2 ** i <= last}
        iters |= set(range(0, last + 1, every)) | doublings
    return iters


# ==================================================================================================
# RESEARCH: what each record measures (a new metric: measure_geometry, its math in geometry.py),
# and the key-spectrum control (a new intervention: where control_step calls control.py).
# ==================================================================================================

@torch.no_grad()
def estimate_loss(model, data, cfg, dev, ctx):
    """Mean loss of eval_iters batches a split: the same windows at every record of every run."""
    model.eval()
    generator = torch.Generator().manual_seed(EVAL_SEED)  # one stream, the splits in turn
    out = {}
    for split, tokens in data.items():
        losses = []
        for _ in range(cfg['eval_iters']):
            offsets = random_offsets(tokens, (cfg['batch_size'],), cfg['block_size'], generator)
            x, y = get_batch(tokens, offsets, cfg['block_size'])
            with ctx:
                losses.append(model(x.to(dev), y.to(dev))[1])
        out[split] = float(np.mean(torch.stack(losses).tolist()))  # one host copy a split
    model.train()
    return out


@torch.no_grad()
def measure_geometry(model, eval_x, eval_y, n_head, w0):
    """The evaluation batch's loss and geometry.py's metrics per layer (None: not finite).
    They come to the host in one copy, as each copy stalls a GPU."""
    model.eval()
    probe = []
    loss = model(eval_x, eval_y, probe=probe)[1]  # float32, explicit attention
    model.train()
    return geometry.record(model.qk_weights(), w0, probe, loss, n_head)


def measure(run, it):
    """One metrics.jsonl record: the losses (at loss iterations),
    and each layer's geometry and the control's PRs."""
    cfg = run.cfg
    tokens = it * cfg['batch_size'] * cfg['grad_accum'] * cfg['block_size']
    row = {'iter': it, 'tokens': tokens, 'lr': get_lr(it, cfg)}
    if it in loss_iters(cfg):
        losses = estimate_loss(run.model, run.data, cfg, run.dev, run.ctx)
        row.update(train_loss=losses['train'], val_loss=losses['val'])
    t0 = time.time()
    if cfg['geom_interval']:
        loss, layers = measure_geometry(run.model, *run.eval_batch, cfg['n_head'], run.w0)
        if layers is None:
            nan_stop('the evaluation batch gave a loss or activations that are not finite', it, run)
        for layer, control_row in zip(layers, spectrum_control.report(run.ctl)):
            layer.update(control_row)
        row['eval_loss'], row['layers'] = loss, layers
    run.t_geom += time.time() - t0
    return row


def control_step(run, step):
    """The causal experiment: reshape the controlled spectra after optimizer step number `step`."""
    if run.cfg['control'] == 'none':
        return
    # the queued backward and step are not control time
    sync = getattr(torch, run.dev.split(':')[0]).synchronize
    t0 = sync() or time.time()
    spectrum_control.apply(run.ctl, run.cfg, run.model.qk_weights(), step)
    run.t_ctl += (sync() or time.time()) - t0


# ------------------------------------------------------------------------------------------ the run

@dataclass
class Run:
    """What a training process holds: built by setup(), advanced by loop(), written by runfolder."""
    cfg: dict                     # the settings (get_config)
    ddp: bool                     # under torchrun (runfolder.start)
    rank: int                     # this process's rank among the world processes
    world: int
    dev: str                      # cpu, cuda, cuda:1, mps
    dir: str = ''                 # out_dir/run_name
    lock: object = None           # dir/.lock, held while this process trains there (rank 0)
    meta: dict = None             # the encoded text's vocab_size, chars, sha256, ... (prepare.py)
    data: dict = None             # 'train', 'val': the encoded text, uint16 memmaps
    data_gen: torch.Generator = field(default_factory=torch.Generator)  # seeded each step
    eval_batch: tuple = ()        # the fixed evaluation windows (x, y) on dev, alike for every run
    model: GPT = None
    train_model: nn.Module = None  # the model a training step calls: compiled, DDP-wrapped if asked
    optimizer: torch.optim.Optimizer = None
    ctl: dict = None              # the control's state: the step-0 spectra it steers from
    first: dict = None            # the record at start, measured before the folder is touched
    wandb: object = None          # the wandb module, if wandb_log (rank 0)
    w0: torch.Tensor = None       # each layer's W_Q, W_K at step 0, (n_layer, 2, C, C)
    dtype: str = 'float32'        # the autocast dtype, ckpt.pt's on resuming: it changes numbers
    threads: int = 1              # CPU threads, ckpt.pt's on resuming: they change the numbers too
    ctx: object = contextlib.nullcontext()  # autocast to dtype, or nothing
    start: int = 0                # this process's first iteration: 0, or the one ckpt.pt holds
    saved_at: int = None          # the iteration ckpt.pt holds
    elapsed: float = 0.0          # wall seconds of the run's earlier processes
    metrics: object = None        # metrics.jsonl, open to append (rank 0)
    losses: list = field(default_factory=list)  # (iteration, loss on dev) the host has not read
    last: dict = field(default_factory=dict)    # the latest record, for done.json
    t_start: float = 0.0          # when this process's loop began
    t_geom: float = 0.0           # seconds measuring geometry and writing snapshots and models
    t_ctl: float = 0.0            # seconds in the control
    mark: tuple = (0.0, 0)        # (time, iteration) that ms/iter and the ETA count training from

    @property
    def master(self):
        return self.rank == 0

    @property
    def ckpt_path(self):
        return os.path.join(self.dir, 'ckpt.pt')


def train(cfg):
    """Trains, logs and checkpoints one run from its config, resumed if unfinished; its folder."""
    run = Run(cfg, *runfolder.start(cfg['device']))
    with runfolder.held(run):  # out of memory or of disk space is one line; no .lock is left behind
        setup(run)
        with runfolder.signals_caught(run) as caught:  # acted on between two iterations
            loop(run, caught)
            finish(run)  # a signal here: the run still ends with ckpt.pt and done.json
    return run.dir


def setup(run):
    """Seeds and numerics; the data; the run folder locked; the model, optimizer and its state,
    a first batch and the first record built. Only then is the folder started over or trimmed
    to ckpt.pt, so that a check or an allocation that fails leaves it as it was."""
    cfg, device_type = run.cfg, run.dev.split(':')[0]
    if cfg['grad_accum'] % run.world:
        raise configurator.Stop(f"grad_accum={cfg['grad_accum']} must be divisible by "
                                f"the {run.world} DDP processes")
    run.wandb = runfolder.import_wandb(cfg) if run.master else None  # None unless wandb_log
    torch.manual_seed(cfg['seed'])  # the init, alike on every DDP rank; each step seeds its draws
    runfolder.set_numerics(run, cfg['dtype'], cfg['threads'])
    run.dir, run.lock = runfolder.claim(cfg, run.master)
    train_data, val_data, run.meta = prepare.prepare_data(cfg)
    run.data = {'train': train_data, 'val': val_data}
    resuming = os.path.exists(run.ckpt_path) and not cfg['overwrite']
    run.eval_batch = tuple(t.to(run.dev) for t in eval_batch(val_data, cfg))
    build_model(run, device_type, resuming)
    run.t_start = time.time()
    if run.master and run.start in log_iters(cfg):  # where measuring may fail: before begin()
        run.first = measure(run, run.start)
    if run.master:
        runfolder.begin(run, resuming)
    compiled = cfg['compile'] and device_type != 'mps'
    run.train_model = torch.compile(run.model) if compiled else run.model
    if run.ddp:  # on CUDA, the device start() made current
        run.train_model = nn.parallel.DistributedDataParallel(run.train_model)


def build_model(run, device_type, resuming):
    """The model, optimizer and control state, ckpt.pt's over them when resuming. Then a micro-batch
    forward and backward pass and the optimizer's state, so that memory the run cannot have fails
    before the run folder is touched; the pass's time gives the first estimate of the run's."""
    cfg = run.cfg
    sizes = GPTConfig(run.meta['vocab_size'], cfg['block_size'], cfg['n_layer'], cfg['n_head'],
                      cfg['n_embd'], cfg['dropout'])
    run.model = GPT(sizes, cfg['qk_init']).to(run.dev)
    runfolder.print_sizes(run)  # at any size, a line within seconds of the data
    run.optimizer = make_optimizer(run.model, cfg, device_type)
    run.ctl = spectrum_control.record(cfg, run.model.qk_weights())
    run.w0 = torch.stack([torch.stack(pair) for pair in run.model.qk_weights()]).detach()
    if resuming:
        runfolder.resume(run)
    first = torch.zeros(cfg['batch_size'], dtype=int)  # any windows: only their memory matters
    x, y = get_batch(run.data['train'], first, cfg['block_size'])
    sync = getattr(torch, device_type).synchronize
    t0 = sync() or time.time()
    with run.ctx:
        run.model(x.to(run.dev), y.to(run.dev))[1].backward()
    seconds = ((sync() or time.time()) - t0) * cfg['grad_accum'] / run.world
    runfolder.allocate_state(run.optimizer)
    runfolder.print_time_left(run, run.start, seconds)
    run.optimizer.zero_grad(set_to_none=True)


def loop(run, caught):
    """Records at the logged iterations, optimizer steps, the control; ckpt.pt every ckpt_interval
    and once a signal is caught."""
    cfg, logs = run.cfg, log_iters(run.cfg)
    run.mark = (time.time(), run.start)
    for it in range(run.start, cfg['max_iters'] + 1):
        ckpt_due = it > run.start and it % cfg['ckpt_interval'] == 0
        stop = caught and not run.ddp
        if it in logs or ckpt_due:  # DDP ranks read their losses (and a signal) together here
            stop = check_losses(run, len(caught))
        if stop:
            checkpoint(run, it)
            sys.exit(f'stopped at iteration {it}: ckpt.pt holds it, '
                     'and the same command resumes from there')
        if run.master and it in logs:
            record(run, it)
        if it == cfg['max_iters']:
            break
        if ckpt_due:
            checkpoint(run, it)
        train_step(run, it)
        control_step(run, it + 1)
        if run.master and it + 1 == run.start + 5 < cfg['max_iters']:  # a CPU can take hours
            runfolder.print_time_left(run, it + 1)


def train_step(run, it):
    """One optimizer step over this rank's share of grad_accum micro-batches. Its loss stays on
    the device, for check_losses to read with the others in one copy."""
    cfg, data, micro_steps = run.cfg, run.data['train'], run.cfg['grad_accum'] // run.world
    for group in run.optimizer.param_groups:
        group['lr'] = get_lr(it, cfg)
    runfolder.seed_all(cfg['seed'], run.rank, it, run.data_gen)  # as if drawn uninterrupted
    # every rank draws the whole global batch's offsets, so the data stream does not depend on world
    shape = (cfg['grad_accum'], cfg['batch_size'])
    offsets = random_offsets(data, shape, cfg['block_size'], run.data_gen)
    step_loss = 0.0
    for m in range(micro_steps):
        x, y = get_batch(data, offsets[run.rank * micro_steps + m], cfg['block_size'],
                         pin='cuda' in run.dev)
        if run.ddp:  # the ranks average their gradients at the last micro-step only
            run.train_model.require_backward_grad_sync = m == micro_steps - 1
        x, y = x.to(run.dev, non_blocking=True), y.to(run.dev, non_blocking=True)
        with run.ctx:
            loss = run.train_model(x, y)[1] / micro_steps
        loss.backward()
        step_loss = step_loss + loss.detach().float()
    run.losses.append((it, step_loss))
    if cfg['grad_clip']:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg['grad_clip'])
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def check_losses(run, caught):
    """Whether a rank got a signal, read on the host with the losses since the last read.
    A loss that is not finite stops every DDP rank."""
    signals = torch.tensor(float(caught), device=run.dev)
    values = torch.stack([loss for _, loss in run.losses] + [signals])
    if run.ddp:
        torch.distributed.all_reduce(values)
    *losses, signals = values.tolist()
    for (step, _), loss in zip(run.losses, losses):
        if not math.isfinite(loss):
            nan_stop(f'the loss became {loss}', step, run)
    run.losses = []
    return signals > 0


def nan_stop(what, it, run):
    kept = 'no ckpt.pt yet' if run.saved_at is None else f'ckpt.pt holds iteration {run.saved_at}'
    raise configurator.Stop(f"{what} at iteration {it}; the run stops ({kept}). "
                            f"Lower --lr (now {run.cfg['lr']}) or lengthen --warmup_iters, "
                            "then rerun with --overwrite=True")


# ----------------------------------------------------------------------- what the run writes

def record(run, it):
    """Measure (RESEARCH above), then write the record and the iteration's weights."""
    started = time.time()
    row = run.first if it == run.start and run.first else measure(run, it)
    runfolder.write_record(run, row, started, it in geometry.model_ckpt_iters(run.cfg))


def checkpoint(run, it):
    """ckpt.pt, never of weights that are not finite."""
    if not torch.stack([torch.isfinite(p).all() for p in run.model.parameters()]).all():
        nan_stop('the weights are no longer finite', it, run)
    if run.master:
        runfolder.save_checkpoint(run, it)


def finish(run):
    """The final checkpoint, then done.json, a sweep's sign of a complete run."""
    checkpoint(run, run.cfg['max_iters'])
    run.elapsed += time.time() - run.t_start
    if run.master:
        runfolder.write_done(run)
    if run.ddp:
        torch.distributed.barrier()  # every rank got here: rank 0 has finished writing


# ------------------------------------------------------------------------------------------- main

def get_config(argv):
    """The config block above, then config files, then --key=value, checked against SETTINGS."""
    defaults = {k: globals()[k] for k in config_keys}
    return configurator.get_config(argv, defaults, SETTINGS, globals())


def main(argv):
    """train.py [CONFIG_FILE ...] [--key=value ...]; -h or --help lists the settings"""
    if {'-h', '--help'} & set(argv):
        return print(__doc__.strip() + '\n\n' + configurator.help_text(__file__, config_keys))
    try:
        train(get_config(argv))
    except configurator.Stop as e:
        print(f'error: {e.code}', file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == '__main__':
    main(sys.argv[1:])
