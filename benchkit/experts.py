"""Mixtral over data-parallel ranks both ways, as ``scripts/bench_experts.py`` runs them: ours (the LLaMA recipe's
sparse MLP, its experts split over the ranks by ``recipes.llama.plan.EXPERTS``) and ``transformers``'
``MixtralForCausalLM`` under ``DistributedDataParallel`` (every rank holds every expert; gradients all-reduced).

Both start from the same weights (ours, with the peer's ``gate_up_proj`` the concatenation of our gate and
up projections), read the same samples (each rank its half of the batch) and train with AdamW. The peer's
experts run ``transformers``' eager loop (each expert on the tokens routed to it); its load-balancing loss is
off (``output_router_logits`` false), and so is ours (``router_aux_loss_coef=0``), so that with a capacity of
0 (no choice dropped) the two compute the same losses.
"""
from __future__ import annotations


import torch

from benchkit.paired import timed_steps

ADAMW = dict(lr=1e-3, weight_decay=0.1)


def as_transformers(state: dict) -> dict:
    """Our Mixtral's state dict with ``transformers`` 5's names: each layer's ``experts.gate_up_proj`` is our
    ``gate_proj`` and ``up_proj`` concatenated on dim 1."""
    out = {}
    for name, v in state.items():
        if name.endswith("experts.gate_proj"):
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat((v, state[name[:-len("gate_proj")] + "up_proj"]), 1)
        elif not name.endswith("experts.up_proj"):
            out[name] = v
    return out


def _state_bytes(params) -> int:
    """This rank's bytes of weights, gradients and AdamW's two moments (fp32): four copies of its local numel."""
    from sbp_core import GlobalTensor

    return 4 * 4 * sum((p.to_local() if isinstance(p, GlobalTensor) else p).numel() for p in params)


def experts_worker(dims: dict, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """On every rank: each way's step times (s), its warm-up losses, its model-state bytes and the bytes this rank
    sent in one more step (ours: the comm ledger; the peer: its gradient buckets' all-reduces, ring)."""
    import torch.distributed as dist
    import transformers
    from torch.nn.parallel import DistributedDataParallel

    import sbp_core as sc
    from recipes.llama import plan as llama_plan
    from recipes.llama.model import LlamaConfig, LlamaForCausalLM
    from sbp_core.sbp import Broadcast, Split

    n, me = dist.get_world_size(), dist.get_rank()
    cfg = LlamaConfig(**dims, router_aux_loss_coef=0.0)
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg)
    peer = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, sliding_window=None,
        attn_implementation="sdpa", experts_implementation="eager"))
    peer.load_state_dict(as_transformers(ours.state_dict()), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    mine = ids.tensor_split(n)[me]

    p = sc.placement("cpu", [[r] for r in range(n)])  # (dp, tp) with tp = 1
    sc.distribute_module(ours, p, llama_plan.mesh_plan(experts=True))
    ours_opt = torch.optim.AdamW(ours.parameters(), **ADAMW)
    gids = sc.to_global(mine, placement=p, sbp=(Split(0), Broadcast()))

    sent = {"peer": 0}

    def counted(state, bucket):  # DDP's all-reduce of a gradient bucket, its ring bytes counted
        buf = bucket.buffer()
        sent["peer"] += 2 * (n - 1) * buf.numel() * buf.element_size() // n
        return dist.all_reduce(buf.div_(n), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp = DistributedDataParallel(peer)
    ddp.register_comm_hook(None, counted)
    peer_opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)

    def ours_step(read: bool = True):
        loss = ours(gids, gids)[1]
        loss.backward()
        ours_opt.step()
        ours_opt.zero_grad()
        return loss.detach().full_tensor() if read else None

    def peer_step():
        loss = ddp(input_ids=mine, labels=mine).loss
        loss.backward()
        peer_opt.step()
        peer_opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)  # the batch's mean (halves of equal size), for the warm-up comparison only
        return value / n

    times, losses = timed_steps({"ours": ours_step, "peer": peer_step}, steps, warmup, dist.barrier, float)
    with sc.comm_ledger() as ledger:
        ours_step(read=False)
    sent["peer"] = 0  # the hook counts gradient buckets only (not the loss read above)
    peer_step()
    return {"times": times, "losses": losses, "sent": {"ours": ledger.bytes, "peer": sent["peer"]},
            "ops": sorted({r.op for r in ledger.records}),
            "state": {"ours": _state_bytes(ours.parameters()), "peer": _state_bytes(peer.parameters())},
            "params": sum(q.numel() for q in peer.parameters())}
