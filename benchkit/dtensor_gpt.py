"""The dispatch benchmarks' workloads: a chain of single ops timed on plain tensors, our global tensors and
DTensor, and GPT-2 under tensor parallelism both ways (ours: the Megatron plan; the peer: DTensor's
parallelize_module and loss_parallel), as scripts/bench_dispatch.py and scripts/profile_hot_path.py run them."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

ROWS, HID = 16, 64
IMPLS = ("torch", "ours", "dtensor")


# -- the op chain ------------------------------------------------------------
# Each op takes (x, w, b, g, beta): activations [16, 64], weight [64, 64],
# bias [64], LayerNorm weight and bias [64].
OPS = {
    "add": lambda x, w, b, g, beta: x + x,
    "mul": lambda x, w, b, g, beta: x * x,
    "relu": lambda x, w, b, g, beta: torch.relu(x),
    "gelu": lambda x, w, b, g, beta: F.gelu(x, approximate="tanh"),
    "sum(dim=-1)": lambda x, w, b, g, beta: x.sum(-1),
    "view": lambda x, w, b, g, beta: x.view(-1, 4, HID // 4),
    "reshape(-1)": lambda x, w, b, g, beta: x.reshape(-1),
    "transpose": lambda x, w, b, g, beta: x.transpose(0, 1),
    "matmul": lambda x, w, b, g, beta: x @ w,
    "linear": lambda x, w, b, g, beta: F.linear(x, w, b),
    "layer_norm": lambda x, w, b, g, beta: F.layer_norm(x, (HID,), g, beta),
    "softmax": lambda x, w, b, g, beta: x.softmax(-1),
}
LAYOUTS = ("S0", "B")


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, HID, generator=gen), torch.randn(HID, HID, generator=gen),
            torch.randn(HID, generator=gen), torch.randn(HID, generator=gen), torch.randn(HID, generator=gen))


def _shard(t, n, me):
    return torch.tensor_split(t, n, 0)[me].contiguous()


def _local_of(out):
    from sbp_core import GlobalTensor
    from torch.distributed.tensor import DTensor

    if isinstance(out, GlobalTensor):
        return out._local
    if isinstance(out, DTensor):
        return out._local_tensor
    return out


def op_worker(reps: int, inner: int, warmup: int) -> list:
    """On every rank: ``[(op, layout, {impl: median us per call})]``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import sbp_core as sc
    from sbp_core import sbp

    n, me = dist.get_world_size(), dist.get_rank()
    p = sc.placement("cpu", list(range(n)))
    mesh = init_device_mesh("cpu", (n,))
    full = _inputs()
    rows = []
    with torch.no_grad():
        for layout in LAYOUTS:
            split = layout == "S0"
            locals_ = [(_shard(t, n, me) if split and i == 0 else t.clone()) for i, t in enumerate(full)]
            ours = [sc.distribute(t, p, sbp.split(0) if split and i == 0 else sbp.broadcast) for i, t in enumerate(full)]
            dts = [DTensor.from_local(loc, mesh, [Shard(0) if split and i == 0 else Replicate()], run_check=False)
                   for i, loc in enumerate(locals_)]
            args = {"torch": locals_, "ours": ours, "dtensor": dts}
            for name, fn in OPS.items():
                want = fn(*locals_)
                for impl in ("ours", "dtensor"):
                    got = _local_of(fn(*args[impl]))
                    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                        raise AssertionError(f"{name} {layout} on {n} ranks: {impl}'s shard differs from plain torch")
                for impl in IMPLS:
                    a = args[impl]
                    for _ in range(warmup):
                        fn(*a)
                times = {impl: [] for impl in IMPLS}
                for r in range(reps):
                    for k in range(len(IMPLS)):
                        impl = IMPLS[(r + k) % len(IMPLS)]
                        a = args[impl]
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            fn(*a)
                        times[impl].append((time.perf_counter() - t0) / inner * 1e6)
                rows.append((name, layout, {impl: statistics.median(v) for impl, v in times.items()}))
    return rows


# -- GPT-2 for DTensor: same shapes and math as recipes/gpt2/model.py, with nn.Linear --


class DTAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hs = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # output rows grouped per head: [q_h, k_h, v_h]
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        b, t, _ = x.shape
        # Local columns after ColwiseParallel: this rank's whole heads.
        qkv = self.c_attn(x).view(b, t, -1, 3 * self.hs)
        q, k, v = (z.transpose(1, 2) for z in qkv.split(self.hs, dim=3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class DTMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class DTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = DTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = DTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class DTGPT2(nn.Module):
    """``forward(ids) -> logits`` (a ``Shard(-1)`` DTensor once parallelised)."""

    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(DTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def load_from(self, ref):
        """Copy ``recipes.gpt2`` weights (``Conv1D`` ``[in, out]`` -> ``nn.Linear`` ``[out, in]``)."""
        own = dict(self.named_parameters())
        for name, q in ref.named_parameters():
            name = name.removeprefix("transformer.")
            src = q.t() if q.dim() == 2 and (".c_attn." in name or ".c_proj." in name or ".c_fc." in name) else q
            own[name].copy_(src)


def _dtensor_tp(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.h)):
        plan[f"h.{i}.attn.c_attn"] = ColwiseParallel()
        plan[f"h.{i}.attn.c_proj"] = RowwiseParallel()
        plan[f"h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"h.{i}.mlp.c_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # both Shard(0) on the vocab rows: keep them one parameter
    return model


def tp_worker(batch: int, seq: int, steps: int, warmup: int) -> dict:
    """On every rank: step times (s) of ours and DTensor, and both runs' losses.

    Kept whole so that both sides are built, warmed up and timed by the same lines, in one order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    import sbp_core as sc
    from recipes.gpt2.model import GPT2LMHeadModel
    from sbp_core import sbp
    from benchkit.parity import GPT_CFG, GPT_TP, GPT_TP_PINS

    cfg = GPT_CFG
    assert seq <= cfg.n_positions, f"seq {seq} exceeds n_positions {cfg.n_positions}"
    n = dist.get_world_size()
    adamw = dict(lr=1e-3, weight_decay=0.1)
    torch.manual_seed(0)
    ours = GPT2LMHeadModel(cfg)
    dtm = DTGPT2(cfg)
    dtm.load_from(ours)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    p = sc.placement("cpu", list(range(n)))
    sc.distribute_module(ours, p, {**GPT_TP, **GPT_TP_PINS})
    ours_opt = torch.optim.AdamW(ours.parameters(), **adamw)
    gids = sc.distribute(ids, p, sbp.broadcast)

    mesh = init_device_mesh("cpu", (n,))
    _dtensor_tp(dtm, mesh)
    dt_opt = torch.optim.AdamW(dtm.parameters(), **adamw)
    x_ids, y_ids = ids, ids[:, 1:].reshape(-1)

    def ours_step():
        loss = ours(gids, gids)[1]
        loss.backward()
        ours_opt.step()
        ours_opt.zero_grad()
        return loss

    def dt_step():
        logits = dtm(x_ids)
        with loss_parallel():
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y_ids)
            loss.backward()
        dt_opt.step()
        dt_opt.zero_grad()
        return loss

    losses = {"ours": [], "dtensor": []}
    times = {"ours": [], "dtensor": []}
    for i in range(warmup + steps):
        order = (("ours", ours_step), ("dtensor", dt_step))
        for name, step in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = step()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
            else:  # outside the timed region: the loss on every rank
                losses[name].append(loss.full_tensor().item())
    return {"times": times, "losses": losses, "params": sum(q.numel() for q in dtm.parameters()),
            "collectives": collectives_of(ours_step, dt_step)}


def collectives_of(ours_step, dtensor_step) -> dict:
    """``{"ours": n, "dtensor": m}``: the collectives of one more step each, untimed (ours: the comm ledger;
    DTensor: ``CommDebugMode``)."""
    import warnings

    from torch.distributed.tensor.debug import CommDebugMode

    import sbp_core as sc

    with sc.comm_ledger() as ledger:
        ours_step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CommDebugMode's module hooks warn about inputs without grad
        with CommDebugMode() as comm:
            dtensor_step()
    return {"ours": ledger.count(), "dtensor": comm.get_total_counts()}


# -- reporting -------------------------------------------------------------
