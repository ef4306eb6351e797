"""Runtime overhead per action and per message, and actions per second.

    python scripts/bench_actor.py

- one thread: a chain of trivial actors on the compute queue (every action
  sends one ``req`` and one ``ack``);
- two threads: the same chain alternating between the data and compute
  queues (every message crosses threads);
- overhead = run time minus the same actions called directly, per action.

It compares the overhead with the forward+backward time of one micro-batch
of the tiny GPT-2 (``scripts/verify_parity.GPT_CFG``, batch 8 x 32 tokens)
on one device.

- two ranks: a chain alternating between ranks 0 and 1 (every edge is a
  send actor, a gloo transfer of a small tensor and a receive actor); the
  row reports wall time per user action and per transfer.
"""
from __future__ import annotations

import time

import torch


from runtime.executor import run
from runtime.plan import ActorSpec, Plan


def _noop(k, *xs):
    return k


def _chain(length, queues):
    specs = [ActorSpec("a0", _noop, queue=queues[0])]
    for i in range(1, length):
        specs.append(ActorSpec(f"a{i}", _noop, inputs=(f"a{i - 1}",), queue=queues[i % len(queues)]))
    return Plan(specs)


def _per_action(plan, pieces, repeat=5):
    n = len(plan.actors) * pieces
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        run(plan, pieces)
        best = min(best, time.perf_counter() - t)
    t = time.perf_counter()
    for k in range(n):
        _noop(k, k)
    direct = time.perf_counter() - t
    return (best - direct) / n * 1e6, n / best


def _two_rank_chain(pieces):
    """Worker: a 6-actor chain alternating ranks; returns seconds for ``pieces`` pieces (best of 3)."""
    specs = [ActorSpec("a0", lambda k: torch.zeros(4), rank=0)]
    for i in range(1, 6):
        specs.append(ActorSpec(f"a{i}", lambda k, x: x + 1, inputs=(f"a{i - 1}",), rank=i % 2))
    plan = Plan(specs)
    run(plan, 5)  # warm up: channels and their process groups
    best = float("inf")
    for _ in range(3):
        torch.distributed.barrier()
        t = time.perf_counter()
        run(plan, pieces)
        best = min(best, time.perf_counter() - t)
    return best


def _gpt_stage_ms():
    from recipes.gpt2.model import GPT2LMHeadModel
    from benchkit.parity import GPT_CFG

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT_CFG)
    ids = torch.randint(0, GPT_CFG.vocab_size, (8, 32))
    times = []
    for _ in range(12):
        t = time.perf_counter()
        model(ids, ids)[1].backward()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    torch.set_num_threads(1)
    rows = []
    for label, queues in (("one thread", ("compute",)), ("two threads", ("data", "compute"))):
        plan = _chain(8, queues)
        us, per_s = _per_action(plan, 500)
        rows.append((label, us, per_s))
    print(f"{'setting':14s} {'overhead us/action':>20s} {'us/message':>12s} {'actions/s':>12s}")
    for label, us, per_s in rows:
        print(f"{label:14s} {us:20.1f} {us / 2:12.1f} {per_s:12.0f}")
    from toolkit.rank_pool import get_pool

    pieces = 200
    secs = max(get_pool(2).run(_two_rank_chain, pieces))
    per_action = secs / (6 * pieces) * 1e6
    per_transfer = secs / (5 * pieces) * 1e6
    print(f"{'two ranks':14s} {per_action:20.1f} {per_transfer:12.1f} {6 * pieces / secs:12.0f}"
          "   (wall time per action / per cross-rank transfer, chain of 6 over 2 ranks)")
    stage = _gpt_stage_ms()
    worst = max(r[1] for r in rows)
    # A pipeline stage runs a forward and a backward actor per micro-batch, plus ~2 transfers.
    share = 4 * worst / (stage * 1e3) * 100
    print(f"tiny GPT-2 fwd+bwd per micro-batch: {stage:.1f} ms; 4 actions of overhead = {share:.2f}% of it")
    print(f"actor overhead per action: {worst:.0f} us")


if __name__ == "__main__":
    main()
