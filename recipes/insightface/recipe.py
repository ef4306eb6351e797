"""The InsightFace recipe: face recognition with a class-split margin-softmax FC, for ``toolkit.trainer``.

Batch fields ``image`` (``float32 [3, S, S]``, read by the model) and
``label`` (``int64``, read by the loss), both ``S(0)`` over every rank of the
``(dp, tp)`` mesh (``plan.py``). Pipeline stages split the backbone's blocks
(``model.pipeline_plan``): the stem on the first stage, the embedding and
the head on the last; a boundary's feature map is ``S(0)`` like the batch,
its shape the producing block's (found on meta tensors by the trainer). Data: ``data.source`` synthetic
(default), rec or image_folder, decoded on the runtime's data queue.
Evaluation every ``trainer.eval_every`` steps: verification accuracy and
TAR@FAR=1e-3 on the pairs ``.bin`` (embeddings of each image plus its
mirror image, as InsightFace evaluates). Optimizer: SGD whose class centres
update only Partial FC's sampled rows (``optim.PartialFCSGD``), or the
trainer's default when ``trainer.optimizer`` is not ``sgd``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch
from omegaconf import OmegaConf

import sbp_core as sc
from sbp_core.layout import local_box
from sbp_core.process_groups import world_rank
from toolkit.data import MicroBatches
from toolkit.data.sampler import GlobalBatchSampler
from toolkit.optim import param_groups
from toolkit.recipe import Recipe

from . import config
from .data import dali, synthetic
from .data.face_records import FaceRecords
from .data.image_folder import ImageFolder
from .data.images import ImageSource, normalize
from .data.pairs import read_pairs
from .data.verification import verification_metrics
from .model import FaceModel, build, build_backbone, pipeline_plan
from .optim import PartialFCSGD
from .plan import DATA_SBP, mesh_plan


@dataclass
class Prepared:
    """What ``prepare`` found: the training source, and the verification pairs (or ``None``)."""

    source: ImageSource
    pairs: tuple | None  # (uint8 [2P, 3, S, S] images, bool [P] issame)
    root: str


class InsightFaceRecipe(Recipe):
    name = "insightface"
    model_schema = config.ModelConfig
    data_schema = config.DataConfig
    data_sbp = DATA_SBP
    inputs = ("image",)
    labels = ("label",)
    act_sbp = DATA_SBP
    throughput_unit = "images"
    rows_weigh_equally = True  # margin softmax loss, the mean over images

    def check(self, cfg, layout) -> list:
        return super().check(cfg, layout) + config.problems(cfg, layout)

    def build_model(self, model_cfg) -> FaceModel:
        """The class centres on the meta device: ``distribute_module`` builds each rank's shard alone."""
        h = model_cfg.head
        return build(str(model_cfg.arch), int(model_cfg.width), int(model_cfg.image_size), int(h.embedding_size),
                     int(model_cfg.num_classes), str(h.loss), float(h.s), config.head_margins(h),
                     float(h.sample_rate), float(model_cfg.dropout), meta_head=True)

    def mesh_plan(self, cfg) -> dict:
        return mesh_plan(cfg)

    def pipeline_plan(self, model_cfg) -> dict:
        return pipeline_plan(str(model_cfg.arch))

    def stage_forward(self, module, x, labels=None):
        """The loss on the last stage; the backbone's feature map (or embedding) before it."""
        return module(x["image"] if isinstance(x, dict) else x, None if labels is None else labels["label"])

    def build_optimizer(self, module, cfg):
        tr = cfg.trainer
        head = module.head  # None on a pipeline stage before the last: no class centres
        if str(tr.optimizer) != "sgd" or head is None:
            return super().build_optimizer(module, cfg)
        # The registered parameter, which the optimizer steps: under ZeRO the attribute is the compute copy.
        weight = dict(head.named_parameters())["weight"]
        return PartialFCSGD(param_groups(module, float(tr.weight_decay)), {weight: head.sampled_rows},
                            lr=float(tr.lr), momentum=float(tr.momentum))

    # -- data ----------------------------------------------------------------------------------

    def batch_fields(self, cfg) -> dict:
        s = int(cfg.data.image_size)
        return {"image": ((3, s, s), torch.float32), "label": ((), torch.int64)}

    def prepare(self, cfg) -> Prepared:
        d, m = cfg.data, cfg.model
        s, pairs = int(d.image_size), d.val_pairs
        if d.source == "synthetic":
            y = d.synthetic
            # The schema's synthetic fields are the generator's own (typed and checked before spawn).
            spec = synthetic.SyntheticSpec(identities=int(m.num_classes), image_size=s, **OmegaConf.to_container(y))
            root = synthetic.ensure(spec, str(d.cache_dir))
            source = FaceRecords(root, s, bool(d.flip))
            pairs = pairs or os.path.join(root, "val.bin")
        else:
            root = os.path.expanduser(str(d.path))
            source = (FaceRecords if d.source == "rec" else ImageFolder)(root, s, bool(d.flip))
        if d.decoder == "dali" or (d.decoder == "auto" and dali.available()):
            # This rank's GPU, as the launcher set it (LOCAL_RANK does not name it where each task sees one).
            source.gpu_decoder = partial(dali.decode, device=torch.device("cuda", torch.cuda.current_device()))
        loaded = read_pairs(os.path.expanduser(str(pairs)), s) if pairs and cfg.trainer.eval_every else None
        return Prepared(source, loaded, root)

    def data(self, cfg, prepared, split: str, shard: int, n_shards: int, layout):
        if split != "train":
            return None  # evaluation is verification on pairs (evaluate), not a validation loss
        source = prepared.source
        sampler = GlobalBatchSampler(len(source), layout.global_batch_size, int(cfg.trainer.seed))
        return MicroBatches(source, sampler, layout.accumulation, n_shards, shard)

    # -- evaluation and accounting -------------------------------------------------------------

    def evaluate(self, job) -> dict | None:
        """Verification accuracy and TAR@FAR=1e-3 on the pairs, every rank embedding its share of them
        (under a pipeline, the stages embed them piece by piece: ``_embed_pipelined``)."""
        if job.data.pairs is None:
            return None
        images, issame = job.data.pairs
        if job.layout.pp > 1:
            emb = self._embed_pipelined(job, torch.cat([images, images.flip(-1)]))
            if emb is None:  # known on rank 0
                return None
            emb = emb[:len(images)] + emb[len(images):]
            return verification_metrics(emb[0::2], emb[1::2], issame)
        module, placement = job.module, job.placements[job.stage]
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                out = []
                for chunk in images.split(int(job.cfg.data.eval_batch_size)):
                    x = normalize(chunk)
                    e = module.embed(sc.distribute(x, placement, DATA_SBP))
                    e = e + module.embed(sc.distribute(x.flip(-1), placement, DATA_SBP))
                    out.append(e.full_tensor().float().cpu())
        finally:
            module.train(was_training)
        emb = torch.cat(out)
        return verification_metrics(emb[0::2], emb[1::2], issame)

    @staticmethod
    def _embed_pipelined(job, images: torch.Tensor):
        """The embeddings of ``images`` (uint8 ``[n, 3, S, S]``), float32 on the host, on rank 0 (``None``
        elsewhere): pieces of a training micro-batch's rows (the last padded with black images) through
        the pipeline's stages (``PipelineStep.infer``), each first-stage rank reading its rows of each."""
        rows = job.pipe.cfg.batch["image"][0][0]
        n = len(images)
        pieces = -(-n // rows)
        placement = job.placements[0]  # the first stage's
        shape = (rows, *images.shape[1:])

        def batches(step, k):
            piece = images[k * rows:(k + 1) * rows]
            if len(piece) < rows:
                piece = torch.cat([piece, piece.new_zeros(rows - len(piece), *piece.shape[1:])])
            (r0, nr) = local_box(shape, placement.shape, DATA_SBP, placement.coords(world_rank()))[0]
            return {"image": normalize(piece[r0:r0 + nr]).to(placement.device())}

        out = job.pipe.infer(batches, pieces, lambda module, x: module.embed(x["image"] if isinstance(x, dict) else x),
                             fields=("image",))
        return None if out is None else torch.cat(out)[:n].float().cpu()

    def items_per_sample(self, cfg) -> int:
        return 1

    def flops_per_item(self, cfg, n_params: int) -> float:
        """Training FLOPs per image: 3x the forward's (backbone, counted by torch on meta tensors, plus the FC)."""
        from torch.utils.flop_counter import FlopCounterMode

        m, s = cfg.model, int(cfg.model.image_size)
        with torch.device("meta"):
            backbone = build_backbone(str(m.arch), int(m.width), s, int(m.head.embedding_size)).eval()
            with FlopCounterMode(display=False) as counter:
                backbone(torch.empty(1, 3, s, s))
        fc = 2 * int(m.head.embedding_size) * int(m.num_classes) * float(m.head.sample_rate)
        return 3.0 * (counter.get_total_flops() + fc)

    def extra_state(self, cfg) -> dict:
        return {"num_classes": int(cfg.model.num_classes), "embedding_size": int(cfg.model.head.embedding_size)}


RECIPE = InsightFaceRecipe()
