"""The one-device cases our trainer and a plain loop are timed on, as Hydra overrides.

``GPU``: the shapes users train on one GPU (``scripts/bench_gpu.py``);
``HOST``: the same recipes at shapes where kernels are cheap on a CPU, so a
step is host work (``bench_gpu.py --host-only``, ``scripts/bench_data_feed.py``).
``COMMON``: what every case adds (no logger, evaluation or checkpoints).
"""
from __future__ import annotations

COMMON = ["logger=none", "trainer.eval_every=0", "trainer.save_every=0", "trainer.warmup_steps=2"]
GPU = {
    "gpt2": ["recipe=gpt2", "model=gpt2", "trainer.precision=bf16", "trainer.micro_batch_size=8",
             "trainer.global_batch_size=8", "data.max_bytes=2000000", "model.dropout=0.0"],
    "insightface": ["recipe=insightface", "model=iresnet50", "trainer.precision=bf16", "model.num_classes=1000",
                    "trainer.micro_batch_size=128", "trainer.global_batch_size=128",
                    "data.synthetic.images_per_identity=4"],
    "wide_deep_512": ["recipe=wide_deep", "model.dropout=0.0"],
    "wide_deep_16384": ["recipe=wide_deep", "model.dropout=0.0", "trainer.micro_batch_size=16384",
                        "trainer.global_batch_size=16384"],
}
HOST = {
    "gpt2": ["recipe=gpt2", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.vocab_size=512",
             "model.n_positions=64", "data.max_bytes=300000", "trainer.micro_batch_size=8",
             "trainer.global_batch_size=8", "model.dropout=0.0"],
    "insightface": ["recipe=insightface", "trainer.micro_batch_size=16", "trainer.global_batch_size=16",
                    "data.synthetic.images_per_identity=4"],
    "wide_deep_512": ["recipe=wide_deep", "model=wide-deep-tiny", "trainer.micro_batch_size=512",
                      "trainer.global_batch_size=512", "data.train_rows=200000"],
    "wide_deep_16384": ["recipe=wide_deep", "model=wide-deep-tiny", "trainer.micro_batch_size=16384",
                        "trainer.global_batch_size=16384", "data.train_rows=1000000"],
}

