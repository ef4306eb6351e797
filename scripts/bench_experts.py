"""Our expert-parallel Mixtral against ``transformers``' ``MixtralForCausalLM`` under ``DistributedDataParallel``.

    python scripts/bench_experts.py [--dp 2] [--experts 8] [--top-k 2] [--layers 2] [--hidden 256]
                                    [--seq 128] [--batch 8] [--steps 10] [--warmup 2] [--capacity-factor 0]

One process tree: a ``--dp``-rank gloo pool (``toolkit.rank_pool``, CPU, one
intra-op thread per rank) builds the same Mixtral twice from one seed
(``benchkit.experts``): ours with its experts split over the ranks (each
holds ``experts / dp``; the tokens move to them and back by all-to-alls) and
by default no choice dropped (``--capacity-factor 0``: every expert runs on
``seq`` slots per sample, ``experts / top-k`` times the routed work; with a
factor ``c`` on ``c * top-k * seq / experts``, dropping choices, so the
losses then differ from the peer's), and the peer replicated by DDP (every rank holds
every expert and all-reduces every gradient; its experts loop over the
tokens routed to each). Both train on the same batch (each rank its half)
with AdamW: ``--warmup`` untimed steps, whose losses must agree (the two
compute the same model), then ``--steps`` timed ones, the two ways in a
balanced order, each step after a barrier. A step's time is the max over
ranks; a way's the median.

Prints the table and a last line ``experts: state per rank X.XXx, sent per
step Y.YYx, throughput Z.ZZx (paired, A.AA-B.BB)`` (ours over the peer's
model-state bytes and bytes sent, below 1 favours ours; throughput ours over
the peer's, above 1 favours ours).
"""
from __future__ import annotations

import argparse
import statistics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=0.0, help="ours' slots per expert (0: none dropped)")
    o = ap.parse_args(argv)
    if o.experts % o.dp or o.batch % o.dp or not 1 <= o.top_k <= o.experts or o.hidden % 8:
        ap.error(f"--experts {o.experts} and --batch {o.batch} must divide by --dp {o.dp}; --top-k within 1.."
                 f"--experts; --hidden by 8 (the heads)")
    if o.steps < 2 or o.warmup < 1:
        ap.error("--steps >= 2 and --warmup >= 1 (the warm-up steps' losses are compared)")

    from benchkit.experts import experts_worker
    from benchkit.paired import paired_ratio
    from toolkit.rank_pool import get_pool

    dims = dict(vocab_size=o.vocab, hidden_size=o.hidden, intermediate_size=2 * o.hidden,
                num_hidden_layers=o.layers, num_attention_heads=8, num_key_value_heads=4,
                max_position_embeddings=o.seq, num_local_experts=o.experts, num_experts_per_tok=o.top_k,
                capacity_factor=o.capacity_factor)
    res = get_pool(o.dp).run(experts_worker, dims, o.batch, o.seq, o.steps, o.warmup)
    step = {k: [max(r["times"][k][i] for r in res) for i in range(o.steps)] for k in ("ours", "peer")}
    med = {k: statistics.median(v) for k, v in step.items()}
    losses = res[0]["losses"]
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["peer"]))
    state = {k: max(r["state"][k] for r in res) for k in ("ours", "peer")}
    sent = {k: max(r["sent"][k] for r in res) for k in ("ours", "peer")}
    print(f"Mixtral {o.layers}x{o.hidden}, {o.experts} experts ({o.top_k} per token) of {2 * o.hidden}, vocab "
          f"{o.vocab}, {res[0]['params'] / 1e6:.1f}M parameters; dp{o.dp}, batch {o.batch} x {o.seq} tokens, fp32, "
          f"AdamW; {o.warmup} warm-up + {o.steps} timed steps each")
    print(f"{'way':28s} {'step ms':>9s} {'tokens/s':>9s} {'state MiB/rank':>15s} {'sent MiB/step':>14s}  warm-up losses")
    names = {"ours": "ours (experts split, a2a)", "peer": "transformers + DDP"}
    for k in ("ours", "peer"):
        print(f"{names[k]:28s} {1e3 * med[k]:9.1f} {o.batch * o.seq / med[k]:9.0f} {state[k] / 2**20:15.2f} "
              f"{sent[k] / 2**20:14.2f}  " + ", ".join(f"{x:.6f}" for x in losses[k]))
    agree = "differ (ours drops choices)" if o.capacity_factor > 0 else "agree"
    print(f"ours' collectives: {', '.join(res[0]['ops'])}; warm-up losses {agree} within {diff:.1e} (relative)")
    ratio, low, high = paired_ratio(step["peer"], step["ours"])
    print(f"experts: state per rank {state['ours'] / state['peer']:.2f}x, sent per step "
          f"{sent['ours'] / sent['peer']:.2f}x, throughput {ratio:.2f}x (paired, {low:.2f}-{high:.2f})")
    return 0 if diff < 1e-4 or o.capacity_factor > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
