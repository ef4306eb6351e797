"""InsightFace's ``cfg.model`` and ``cfg.data``: typed schemas and the checks only this recipe needs.

``configs/model/{iresnet18,iresnet50,mobilefacenet,iresnet18-tiny}.yaml``
and ``configs/data/{synthetic,rec,image_folder}.yaml`` fill them. The class
count is the model's (``model.num_classes``, the FC's rows): the synthetic
generator makes that many identities, and a real dataset must have exactly
that many (checked against its ``property`` file or its class folders before
any process starts).
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import II, OmegaConf

from .data import dali
from .data.face_records import FILES, read_property
from .margin import STANDARD
from .model import ARCHS

DATA_SOURCES = ("synthetic", "rec", "image_folder")
DECODERS = ("auto", "pil", "dali")


@dataclass
class HeadConfig:
    """The margin-softmax head over the class centres.

    - ``loss``: ``arcface`` (m1, m2, m3 = 1, 0.5, 0), ``cosface`` (1, 0, 0.4)
      or ``combined`` (1, 0.3, 0.2); ``m1``/``m2``/``m3`` override the
      loss's margins (InsightFace's CombinedMarginLoss ``cos(m1 t + m2) - m3``);
      ``s``: the logit scale.
    - ``sample_rate``: Partial FC's share of class centres each shard uses per
      step (positives always); 1.0 = every centre (model-parallel FC).
    - ``embedding_size``: the backbone's output and the centres' width.
    """

    loss: str = "arcface"
    m1: Optional[float] = None
    m2: Optional[float] = None
    m3: Optional[float] = None
    s: float = 64.0
    sample_rate: float = 1.0
    embedding_size: int = 512


def head_margins(head) -> Optional[tuple]:
    """``(m1, m2, m3)`` of a ``model.head`` node: the loss's standard margins with the given ones replaced."""
    given = (head.m1, head.m2, head.m3)
    if all(m is None for m in given):
        return None
    return tuple(float(s if m is None else m) for m, s in zip(given, STANDARD.get(head.loss, (1.0, 0.0, 0.0))))


@dataclass
class ModelConfig:
    """The backbone (``arch``: iresnet18/34/50/100 or mobilefacenet, ``width``: the first stage's
    channels, InsightFace's 64 for iResNets and 128 for MobileFaceNet; ``image_size``: a multiple of 16,
    InsightFace's 112), ``num_classes`` identities, and the ``head``."""

    name: str = "iresnet18-tiny"
    arch: str = "iresnet18"
    width: int = 16
    image_size: int = 32
    dropout: float = 0.0
    num_classes: int = 200
    head: HeadConfig = field(default_factory=HeadConfig)


@dataclass
class SyntheticConfig:
    """The generated identities (``recipes/insightface/data/synthetic.py``); their count is ``model.num_classes``."""

    images_per_identity: int = 16
    val_identities: int = 100
    val_pairs: int = 600
    blobs: int = 6
    jitter: float = 0.06
    noise: float = 0.06
    seed: int = 0


@dataclass
class DataConfig:
    """Where the training images come from and how they are read.

    - ``source``: ``synthetic`` (generated once into ``cache_dir``; the
      default, offline), ``rec`` (``path``: a directory with ``train.rec``,
      ``train.idx``, ``property``, as InsightFace ships MS1M/Glint360K), or
      ``image_folder`` (``path/<identity>/<image>``).
    - ``val_pairs``: a verification ``.bin`` (LFW's format) evaluated every
      ``trainer.eval_every`` steps; ``None``: the synthetic set's own
      ``val.bin``, or no verification for other sources.
    - ``flip``: random horizontal flips (as mirrored rows the sampler shuffles).
    - ``decoder``: ``pil``, ``dali`` (NVIDIA DALI on the GPU; needs
      ``nvidia.dali`` and CUDA) or ``auto`` (DALI when both are there).
    - ``eval_batch_size``: images per forward in verification.
    """

    source: str = "synthetic"
    path: Optional[str] = None
    val_pairs: Optional[str] = None
    image_size: int = II("model.image_size")
    flip: bool = True
    decoder: str = "auto"
    eval_batch_size: int = 256
    cache_dir: str = "${oc.env:SBP_CACHE_DIR,'~/.cache/sbp-recipes'}"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


def _dataset_classes(data) -> tuple:
    """``(number of classes the dataset has, a problem or None)``, cheaply, before any process starts."""
    if data.path is None:
        return None, f"data.path=None: data.source={data.source} needs a directory"
    path = os.path.expanduser(str(data.path))
    if data.source == "rec":
        missing = [f for f in FILES if not os.path.isfile(os.path.join(path, f))]
        if missing:
            return None, f"data.path={data.path!r}: lacks {', '.join(missing)} (an InsightFace .rec dataset)"
        try:
            return read_property(path)[0], None
        except ValueError as e:
            return None, str(e)
    if not os.path.isdir(path):
        return None, f"data.path={data.path!r}: not a directory of identity sub-directories"
    return sum(os.path.isdir(os.path.join(path, d)) for d in os.listdir(path)), None


def _synthetic_problems(cfg) -> list:
    """The generator's own checks (``SyntheticSpec.check``), and a global batch the generated images (and
    their mirror images, with ``data.flip``) fill."""
    from .data.synthetic import SyntheticSpec

    spec = SyntheticSpec(identities=int(cfg.model.num_classes), image_size=int(cfg.data.image_size),
                         **OmegaConf.to_container(cfg.data.synthetic))
    try:
        spec.check()
    except ValueError as err:
        return [f"data.synthetic: {str(err).removeprefix('synthetic data: ')}"]
    # With flips the sampler draws from each image and its mirror image.
    images = spec.identities * spec.images_per_identity * (2 if cfg.data.flip else 1)
    batch = int(cfg.trainer.global_batch_size)
    if batch > images:
        return [f"trainer.global_batch_size={batch}: more than the {images} synthetic images (model.num_classes "
                f"x data.synthetic.images_per_identity{', x 2 with flips' if cfg.data.flip else ''}); valid: at "
                f"most {images}, or more images per identity"]
    return []


def problems(cfg, layout) -> list:
    """InsightFace's rules, checked before any process starts."""
    p: list = []
    m, h, d, tr = cfg.model, cfg.model.head, cfg.data, cfg.trainer
    if m.arch not in ARCHS:
        p.append(f"model.arch={m.arch!r}: unknown; valid: {', '.join(ARCHS)}")
    if m.image_size < 16 or m.image_size % 16:
        p.append(f"model.image_size={m.image_size}: must be a positive multiple of 16 (four stride-2 stages), "
                 "e.g. 112")
    if m.width < 2 or (m.arch == "mobilefacenet" and m.width % 2):
        p.append(f"model.width={m.width}: must be >= 2 (and even for mobilefacenet)")
    if not 0.0 <= m.dropout < 1.0:
        p.append(f"model.dropout={m.dropout}: must be in [0, 1)")
    if h.loss not in STANDARD:
        p.append(f"model.head.loss={h.loss!r}: unknown; valid: {', '.join(STANDARD)}")
    if not 0.0 < h.sample_rate <= 1.0:
        p.append(f"model.head.sample_rate={h.sample_rate}: must be in (0, 1] (1.0 = no Partial FC sampling)")
    if h.embedding_size < 1 or h.s <= 0:
        p.append(f"model.head: embedding_size={h.embedding_size} and s={h.s} must be positive")
    ranks = layout.dp * layout.tp
    if m.num_classes < ranks:
        p.append(f"model.num_classes={m.num_classes}: fewer classes than the {ranks} ranks the FC is split "
                 f"over (each holds at least one class centre); valid: >= {ranks}, or fewer ranks")
    if d.image_size != m.image_size:
        p.append(f"data.image_size={d.image_size}: the network takes model.image_size={m.image_size} images; "
                 f"valid: data.image_size={m.image_size} (it follows model.image_size when not set)")
    if d.source not in DATA_SOURCES:
        p.append(f"data.source={d.source!r}: unknown; valid: {', '.join(DATA_SOURCES)}")
    elif d.source == "synthetic":
        p.extend(_synthetic_problems(cfg))
    else:
        n, problem = _dataset_classes(d)
        if problem:
            p.append(problem)
        elif n != m.num_classes:
            p.append(f"data.path={d.path!r} holds {n} classes but model.num_classes={m.num_classes}; "
                     f"valid: model.num_classes={n}")
    if d.val_pairs is not None and not os.path.isfile(os.path.expanduser(str(d.val_pairs))):
        p.append(f"data.val_pairs={d.val_pairs!r}: no such file (a verification .bin such as lfw.bin)")
    if d.decoder not in DECODERS:
        p.append(f"data.decoder={d.decoder!r}: unknown; valid: {', '.join(DECODERS)}")
    elif d.decoder == "dali" and not dali.available():
        p.append(f"data.decoder=dali: {dali.why_unavailable()}; valid: data.decoder=pil or auto")
    if d.eval_batch_size < 1:
        p.append(f"data.eval_batch_size={d.eval_batch_size}: must be >= 1")
    held = [k for k in (cfg.parallel.get("plan") or {})
            if any(fnmatch.fnmatchcase(name, str(k).split(":")[0]) for name in ("head.weight", "head.class_ids"))]
    if held:
        p.append(f"parallel.plan={held}: the class centres and their ids keep their class split (Partial FC's "
                 "sampling and row steps index it, on the ZeRO master too); valid: entries for backbone.* only")
    if tr.activation_checkpointing and tr.compile:
        p.append("trainer.compile=true with trainer.activation_checkpointing=true: torch.compile cannot trace "
                 "the recompute's restoring of batch norm's running statistics (the backbone would run eager); "
                 "valid: one of them")
    if tr.optimizer != "sgd" and h.sample_rate < 1.0:
        p.append(f"trainer.optimizer={tr.optimizer}: Partial FC (model.head.sample_rate={h.sample_rate}) "
                 "updates only the sampled rows with SGD; valid: trainer.optimizer=sgd, or sample_rate=1.0")
    return p
