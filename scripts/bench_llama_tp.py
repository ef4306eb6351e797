"""Our tensor-parallel LLaMA against DTensor's ``parallelize_module`` with torchtitan's Llama plan (``apply_tp``).

    python scripts/bench_llama_tp.py [--tp 2] [--layers 4] [--hidden 256] [--heads 8] [--kv-heads 4]
                                     [--seq 128] [--batch 8] [--steps 12] [--warmup 3] [--sequence-parallel]

One process tree: a ``--tp``-rank gloo pool (``toolkit.rank_pool``, CPU, one
intra-op thread per rank) builds the same ``recipes.llama`` model twice from
one seed, lays one out by our plan (``recipes.llama.plan``: column-split
q/k/v/gate/up, row-split o/down, vocabulary-split embedding and head, the
residual stream whole) and parallelises the other by DTensor with
torchtitan's ``apply_tp`` plan without its sequence parallelism
(``benchkit.llama_tp``); with ``--sequence-parallel`` both split the
sequence between the blocks (ours ``SEQUENCE_PARALLEL``, torchtitan's plan
as it is: ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the
attention's and MLP's input). It trains both on the same batch with
AdamW: ``--warmup`` untimed steps (whose losses must agree: the pair
computes the same thing), then ``--steps`` timed steps, the two ways in a
balanced order (``benchkit.paired.balanced_orders``), each step after a
barrier. A step's time is the max over ranks; a way's the median over its
steps. Prints the table, the paired ratio with its 90% interval, and a last
line ``llama tp: ours X.XXx DTensor (paired Y.YYx, A.AA-B.BB); collectives N vs M``
(throughput, ours / DTensor's; above 1 favours ours).
"""
from __future__ import annotations

import argparse
import statistics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sequence-parallel", action="store_true", help="split the sequence between the blocks")
    o = ap.parse_args(argv)
    if o.kv_heads % o.tp or o.heads % o.kv_heads or o.vocab % o.tp or o.hidden % o.heads:
        ap.error(f"--kv-heads {o.kv_heads} must divide --heads {o.heads} and divide by --tp {o.tp}; --vocab by "
                 f"--tp; --hidden by --heads")
    if o.sequence_parallel and o.seq % o.tp:
        ap.error(f"--sequence-parallel splits --seq {o.seq} over --tp {o.tp}: it must divide")
    if o.steps < 2 or o.warmup < 1:
        ap.error("--steps >= 2 and --warmup >= 1 (the warm-up steps' losses are compared)")

    from benchkit.llama_tp import tp_worker
    from benchkit.paired import paired_ratio
    from toolkit.rank_pool import get_pool

    dims = dict(vocab_size=o.vocab, hidden_size=o.hidden, intermediate_size=(8 * o.hidden // 3 + 31) // 32 * 32,
                num_hidden_layers=o.layers, num_attention_heads=o.heads, num_key_value_heads=o.kv_heads,
                max_position_embeddings=o.seq)
    if dims["intermediate_size"] % o.tp:
        ap.error(f"the MLP width {dims['intermediate_size']} does not divide by --tp {o.tp}")
    res = get_pool(o.tp).run(tp_worker, dims, o.batch, o.seq, o.steps, o.warmup, o.sequence_parallel)
    step = {k: [max(r["times"][k][i] for r in res) for i in range(o.steps)] for k in ("ours", "dtensor")}
    med = {k: statistics.median(v) for k, v in step.items()}
    tokens = o.batch * o.seq
    losses = res[0]["losses"]
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["dtensor"]))
    coll = res[0]["collectives"]
    print(f"LLaMA {o.layers}x{o.hidden}, {o.heads} heads ({o.kv_heads} key/value), MLP {dims['intermediate_size']}, "
          f"vocab {o.vocab}, {res[0]['params'] / 1e6:.1f}M parameters; tp{o.tp}"
          f"{' sequence-parallel' if o.sequence_parallel else ''}, batch {o.batch} x {o.seq} tokens, "
          f"fp32, AdamW; {o.warmup} warm-up + {o.steps} timed steps each")
    print(f"{'way':10s} {'step ms':>9s} {'tokens/s':>10s} {'collectives/step':>17s} {'warm-up losses'}")
    for k in ("ours", "dtensor"):
        print(f"{k:10s} {1e3 * med[k]:9.1f} {tokens / med[k]:10.0f} {coll[k]:17d} "
              + ", ".join(f"{x:.6f}" for x in losses[k]))
    ratio, low, high = paired_ratio(step["dtensor"], step["ours"])
    print(f"warm-up losses agree within {diff:.1e} (relative)")
    print(f"llama tp: ours {med['dtensor'] / med['ours']:.2f}x DTensor (paired {ratio:.2f}x, {low:.2f}-{high:.2f}); "
          f"collectives {coll['ours']} vs {coll['dtensor']}")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
