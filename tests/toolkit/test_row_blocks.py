"""Tables drawn per block of rows (``toolkit.row_blocks``): any box is that box of the whole table, built alone.

Wide&Deep's embedding tables and InsightFace's class centres are built this
way: the recipes leave them on the meta device, and each rank's shard is
drawn by itself, in memory for its rows, with the values one device has.
"""
import pytest
import torch

from recipes.insightface.head import MarginSoftmaxHead
from recipes.insightface.margin import CombinedMargin
from recipes.insightface.recipe import RECIPE as INSIGHTFACE
from recipes.wide_deep.model import BlockInitEmbedding
from toolkit.config.run_config import compose
from toolkit.config.schema import typed
from toolkit.plain_loop import materialized
from toolkit.row_blocks import row_block_box


def _normal(gen, shape):
    return torch.randn(shape, generator=gen)


@pytest.mark.parametrize("box", [((0, 10), (0, 3)), ((3, 5), (1, 2)), ((4, 4), (0, 3)), ((7, 3), (2, 1)),
                                 ((0, 1), (0, 3))])
def test_a_box_is_the_whole_tables_box_whatever_the_blocks_it_crosses(box):
    whole = row_block_box(11, (10, 3), ((0, 10), (0, 3)), _normal, block=4)
    (r0, nr), (c0, nc) = box
    assert torch.equal(row_block_box(11, (10, 3), box, _normal, block=4), whole[r0:r0 + nr, c0:c0 + nc])
    assert not torch.equal(row_block_box(12, (10, 3), box, _normal, block=4), whole[r0:r0 + nr, c0:c0 + nc])


def test_blocks_are_drawn_from_their_own_seeds():
    """Block ``b`` is ``draw`` with the generator seeded ``seed + b``: the last, short block included."""
    whole = row_block_box(5, (10, 3), ((0, 10), (0, 3)), _normal, block=4)
    for b, (lo, hi) in enumerate([(0, 4), (4, 8), (8, 10)]):
        assert torch.equal(whole[lo:hi], torch.randn((hi - lo, 3), generator=torch.Generator().manual_seed(5 + b)))


@pytest.mark.parametrize("make", [
    lambda meta: MarginSoftmaxHead(1000, 8, CombinedMargin.named("arcface"), meta=meta),
    lambda meta: BlockInitEmbedding(1000, 8, 0.05, sparse=True, meta=meta),
])
def test_a_meta_table_builds_any_shard_of_the_table_built_whole(make):
    torch.manual_seed(3)
    whole = make(False).weight.detach()
    torch.manual_seed(3)
    table = make(True)
    assert table.weight.is_meta
    for shards in (2, 4, 8):
        rows = 1000 // shards
        for i in range(shards):
            assert torch.equal(table.init_shard("weight", ((i * rows, rows), (0, 8))), whole[i * rows:(i + 1) * rows])
    assert torch.equal(table.init_shard("weight", ((100, 300), (2, 4))), whole[100:400, 2:6])


def test_insightface_builds_no_class_centres_until_they_are_laid_out():
    """The recipe's model holds its class centres and class ids on the meta device; built whole they are the
    centres of the model built with values (``meta_head=False``) from the same seed, and ``arange(C)``."""
    from recipes.insightface import config
    from recipes.insightface.model import build

    cfg = typed(compose(["recipe=insightface", "model.num_classes=100000"]), INSIGHTFACE)
    torch.manual_seed(0)
    model = INSIGHTFACE.build_model(cfg.model)
    assert model.head.weight.is_meta and not any(p.is_meta for n, p in model.named_parameters() if n != "head.weight")
    assert model.head.class_ids.is_meta
    torch.manual_seed(0)
    head = materialized(INSIGHTFACE.build_model(cfg.model)).head
    assert torch.equal(head.class_ids, torch.arange(100000))
    built = head.weight.detach()
    m, h = cfg.model, cfg.model.head
    assert built.shape == (100000, int(h.embedding_size)) and 0.009 < float(built.std()) < 0.011
    torch.manual_seed(0)
    ref = build(str(m.arch), int(m.width), int(m.image_size), int(h.embedding_size), int(m.num_classes), str(h.loss),
                float(h.s), config.head_margins(h), float(h.sample_rate), float(m.dropout))
    assert torch.equal(built, ref.head.weight)


def test_the_heads_class_ids_are_built_by_box_too():
    """``class_ids`` stays on the meta device with the centres; any row box of it is that slice of
    ``arange(C)``, and the head built with values holds the whole range."""
    head = MarginSoftmaxHead(10, 4, CombinedMargin.named("arcface"), meta=True)
    assert head.class_ids.is_meta and head.class_ids.dtype == torch.int64
    for box in (((0, 10),), ((0, 5),), ((5, 5),), ((3, 4),)):
        (r0, n), = box
        assert torch.equal(head.init_shard("class_ids", box), torch.arange(r0, r0 + n))
    assert torch.equal(MarginSoftmaxHead(10, 4, CombinedMargin.named("arcface")).class_ids, torch.arange(10))
    with pytest.raises(KeyError, match="only 'weight' and 'class_ids'"):
        head.init_shard("draws", ((0, 1),))

