"""TokenSequences and MicroBatches: the rows each rank reads, through actors or plain calls."""
from __future__ import annotations

import array
import pickle

import pytest
import torch

from runtime.executor import run
from runtime.plan import ActorSpec, Plan
from sbp_core.sbp import Broadcast, Split
from toolkit.data.batches import MicroBatches
from toolkit.data.sampler import GlobalBatchSampler, micro_batch_rows
from recipes.gpt2.data.tokens import TokenSequences, token_dtype

SEQ, N_SEQ = 8, 37


@pytest.fixture
def tokens(tmp_path):
    """Token ``k`` is ``k``: sequence ``i`` is ``[i * SEQ, (i + 1) * SEQ)``; 5 tail tokens fit no sequence."""
    path = tmp_path / "tokens.bin"
    path.write_bytes(array.array("i", range(N_SEQ * SEQ + 5)).tobytes())
    return TokenSequences(str(path), SEQ, torch.int32)


def _expected(rows):
    return rows[:, None] * SEQ + torch.arange(SEQ)


def test_token_sequences_random_access(tokens):
    assert len(tokens) == N_SEQ and tokens.n_tokens == N_SEQ * SEQ + 5
    assert torch.equal(tokens[5], torch.arange(5 * SEQ, 6 * SEQ)) and tokens[5].dtype == torch.int64
    rows = torch.tensor([36, 0, 7, 7])
    assert torch.equal(tokens.gather(rows), _expected(rows))
    assert tokens.read(rows).dtype == torch.int32
    with pytest.raises(IndexError, match=r"sequence rows must lie in \[0, 37\), got min 0 max 37"):
        tokens.gather(torch.tensor([0, 37]))
    with pytest.raises(IndexError, match="sequence 37 out of range for 37 sequences"):
        tokens[37]
    clone = pickle.loads(pickle.dumps(tokens))
    assert clone._view is None and torch.equal(clone.gather(rows), _expected(rows))


def test_token_sequences_reject_bad_files(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="7 bytes is not a whole number of torch.int32 ids"):
        TokenSequences(str(path), 1, torch.int32)
    short = tmp_path / "short.bin"
    short.write_bytes(b"\x00" * 6)
    with pytest.raises(ValueError, match=r"3 tokens, fewer than one sequence of 8"):
        TokenSequences(str(short), 8, torch.uint16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        TokenSequences(str(path), 1, torch.int64)
    assert token_dtype(65536) == torch.uint16 and token_dtype(65537) == torch.int32


@pytest.mark.parametrize("global_batch,accum,dp", [(12, 3, 2), (10, 3, 4), (7, 2, 3)])
def test_ranks_and_micro_batches_cover_each_step_exactly(tokens, global_batch, accum, dp):
    sampler = GlobalBatchSampler(len(tokens), global_batch, seed=5)
    ranks = [MicroBatches(tokens, sampler, accum, dp, r) for r in range(dp)]
    for step in (0, 1, 4, 9):
        rows = sampler.rows(step)
        loaded = [ranks[r].load(step, j)['input_ids'] for j in range(accum) for r in range(dp)]
        assert torch.equal(torch.cat(loaded), _expected(rows))
        for j in range(accum):
            for r in range(dp):
                share = micro_batch_rows(rows, accum, j, dp, r)
                assert torch.equal(ranks[r].load(step, j)['input_ids'], _expected(share))
                assert ranks[r].load(step, j)['input_ids'].shape == (len(share), SEQ)


def test_the_actor_pipeline_reads_what_load_reads(tokens):
    accum, steps = 2, 3
    batches = MicroBatches(tokens, GlobalBatchSampler(len(tokens), 8, seed=1), accum=accum, n_shards=2, shard=1,
                           step=4)
    stages = batches.stages(quota=2)
    plan = Plan(stages + [ActorSpec("step", lambda k, b: b["input_ids"].clone(), inputs=(stages[-1].name,))])
    seen = run(plan, accum * steps, timeout=30).outputs["step"]
    want = [batches.load(4 + k // accum, k % accum)['input_ids'] for k in range(accum * steps)]
    assert len(seen) == len(want) and all(torch.equal(a, b) for a, b in zip(seen, want))
    assert all(s.dtype == torch.int64 and s.shape == (2, SEQ) for s in seen)


def test_collate_takes_the_decoded_rows_without_a_copy(tokens):
    batches = MicroBatches(tokens, GlobalBatchSampler(len(tokens), 4, seed=3), accum=1)
    samples = batches.decode(0, batches.read(0))
    batch = batches.collate(0, samples)["input_ids"]
    assert batch.data_ptr() == samples.data_ptr() and torch.equal(batch, batches.load(0, 0)["input_ids"])
    assert torch.equal(tokens.collate(list(samples))["input_ids"], batch)  # a list of sequences is stacked


def test_for_step_is_unaffected_by_a_later_step_change(tokens):
    batches = MicroBatches(tokens, GlobalBatchSampler(len(tokens), 6, seed=2), accum=3)
    bound = batches.for_step(7)
    batches.step = 0
    assert bound.step == 7 and torch.equal(bound.read(1).to(torch.int64), batches.load(7, 1)['input_ids'])
    assert torch.equal(bound.rows(4), batches.rows(3 * 8 + 1))  # piece 4 of step 7 = micro 1 of step 8


def test_empty_shares_collate_to_an_empty_batch(tokens):
    batches = MicroBatches(tokens, GlobalBatchSampler(len(tokens), 2, seed=0), accum=1, n_shards=3, shard=2)
    out = batches.load(0, 0)['input_ids']
    assert out.shape == (0, SEQ) and out.dtype == torch.int64


def test_bad_arguments_name_the_value(tokens):
    sampler = GlobalBatchSampler(len(tokens), 4)
    with pytest.raises(ValueError, match=r"dp_rank must be an int in \[0, dp_size=2\), got 2"):
        MicroBatches(tokens, sampler, 1, 2, 2)
    with pytest.raises(ValueError, match="sampler draws from 100 samples but .* holds 37"):
        MicroBatches(tokens, GlobalBatchSampler(100, 4), 1, 1, 0)
    with pytest.raises(ValueError, match=r"micro must be an int in \[0, accum=2\), got 2"):
        MicroBatches(tokens, sampler, accum=2).load(0, 2)


@pytest.mark.parametrize("sbp, mesh", [((Split(0), Split(0)), (2, 3)), ((Split(0), Broadcast(), Split(0)), (2, 2, 2)),
                                       ((Broadcast(), Split(0)), (3, 2))])
def test_a_ranks_data_shard_holds_the_rows_its_batch_layout_gives_it(sbp, mesh):
    """``data_shard``'s ``(shard, n)``: the rank's rows of a batch are ``tensor_split(n)[shard]``, and those
    are the rows an ``S(0)`` global batch lays out at the rank's mesh coordinates."""
    import itertools

    from sbp_core.layout import local_box
    from toolkit.recipe import data_shard

    rows = 24
    for coords in itertools.product(*(range(n) for n in mesh)):
        shard, n = data_shard(sbp, mesh, coords)
        start, length = local_box((rows, 1), mesh, sbp, coords)[0]
        piece = torch.arange(rows).tensor_split(n)[shard]
        assert piece.tolist() == list(range(start, start + length)), (coords, shard, n)
