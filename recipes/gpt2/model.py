"""GPT-2 as plain torch modules, with ``transformers``' parameter names and shapes.

``GPT2LMHeadModel(GPT2Config(...))`` has ``transformer.wte``, ``.wpe``,
``.h.{i}.ln_1``, ``.attn.c_attn``, ``.attn.c_proj``, ``.ln_2``,
``.mlp.c_fc``, ``.mlp.c_proj``, ``.ln_f`` and ``lm_head`` (tied to ``wte``),
each of the same shape as Hugging Face's (``Conv1D`` weights are
``[in, out]``). One difference of order, not of shape: ``c_attn``'s output
columns are grouped per head (``[q_h, k_h, v_h]`` for each head ``h``) rather
than ``[all q | all k | all v]``, so that a column split of ``c_attn`` gives
each tensor-parallel rank whole heads (Megatron's layout). Checkpoint
conversion permutes those columns.

No communication here: parallel layouts come from a plan. A pipeline stage
is this model with the modules of other stages set to ``None`` (blocks of
``transformer.h`` included), torchtitan-style: ``forward`` skips what is
absent, so a stage's parameter names stay the full model's.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    # Megatron's option: the embedding and LM head get ``padded_vocab_size`` rows (``vocab_size`` rounded up to
    # this multiple) so that a vocabulary like GPT-2's 50257 splits over tensor-parallel ranks; the padded ids'
    # logits are -inf, so their probability is 0 and every value matches the unpadded model's.
    make_vocab_size_divisible_by: int = 1

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple``."""
    return -(-int(vocab_size) // int(multiple)) * int(multiple)


IGNORE = -100  # F.cross_entropy's default ignore_index


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of position ``t``'s logits ``[b, t, vocab]`` against token ``t + 1`` of ``labels`` ``[b, t]``,
    the mean over the ``b * (t - 1)`` positions that have one (Hugging Face's causal-LM loss).

    The last position's target is ignored rather than its logits sliced away: the logits are not copied, and
    with the sequence split (context parallelism) they are not cut unevenly; with one sample a rank's positions
    stay its rows (``view``)."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def _generator(name: str) -> torch.Generator:
    """A CPU generator seeded from the global seed and ``name`` alone."""
    digest = hashlib.sha256(f"{torch.initial_seed()}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


BLOCK_VALUES = 1 << 22  # values drawn at a time by normal_box (16 MiB of fp32)


def normal_box(shape, box, std: float, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """The box ``((start, length), ...)`` of a ``shape`` tensor ``torch.empty(shape).normal_(0, std, generator)``
    would hold, on the CPU; a tensor over twice ``BLOCK_VALUES`` values is drawn holding only the box and one
    block of rows.

    The rows are drawn in order, a block at a time, up to the box's last: ``normal_`` turns its generator's
    stream into values 16 at a time (its last 16 drawn again when the count is not a multiple of 16, and fewer
    than 16 values another way), so blocks of a multiple of 16 values, the last one at least 16, draw what the
    whole tensor draws (``tests/recipes/test_gpt2_stage_init.py`` checks it on this torch).
    """
    region = tuple(slice(start, start + n) for start, n in box)
    if any(n == 0 for _, n in box):  # a rank's share of fewer rows than ranks
        return torch.empty(tuple(n for _, n in box), dtype=dtype, device="cpu")
    if not shape or math.prod(shape) <= 2 * BLOCK_VALUES:
        whole = torch.empty(shape, dtype=dtype, device="cpu").normal_(0.0, std, generator=generator)
        shard = whole[region]
        return shard.clone() if shard.numel() < whole.numel() else whole  # a shard keeps none of the rest
    rows, cols = shape[0], math.prod(shape[1:])
    step = 16 // math.gcd(cols, 16)  # rows per 16 values' worth
    per = max(step, BLOCK_VALUES // cols // step * step)
    (first, n_rows), rest = box[0], region[1:]
    out = torch.empty(tuple(n for _, n in box), dtype=dtype, device="cpu")
    r = 0
    while r < first + n_rows:
        n = min(per, rows - r)
        if 0 < (rows - r - n) * cols < 16:  # a last block under 16 values: drawn with this one
            n = rows - r
        block = torch.empty((n, *shape[1:]), dtype=dtype, device="cpu").normal_(0.0, std, generator=generator)
        lo, hi = max(r, first), min(r + n, first + n_rows)
        if lo < hi:
            out[lo - first:hi - first] = block[(slice(lo - r, hi - r), *rest)]
        r += n
    return out


class Conv1D(nn.Module):
    """``y = x @ weight + bias`` with ``weight`` of shape ``[in, out]`` (GPT-2's layout)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        out_shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(out_shape)


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
        self.attn_pdrop = cfg.attn_pdrop
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)
        if cfg.attn_pdrop > 0:
            # Attention with dropout runs torch's math path (``forward``), whose ``is_causal`` mask is a new
            # plain tensor made inside the op, which a global tensor's op cannot mix with; a buffer is laid
            # out by the plan like any other (B). Hugging Face's GPT-2 keeps such a buffer too (not saved).
            self.register_buffer("causal", torch.ones(cfg.n_positions, cfg.n_positions, dtype=torch.bool).tril(),
                                 persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        hs = c // self.n_head
        qkv = self.c_attn(x).view(b, t, self.n_head, 3 * hs)
        q, k, v = (z.transpose(1, 2) for z in qkv.split(hs, dim=3))
        p = self.attn_pdrop if self.training else 0.0
        if p:
            # The math path draws its dropout mask with ``dropout``, for the whole tensor on any layout (a
            # fused CUDA kernel would draw one per shard): CPU takes that path by itself, CUDA is told to.
            with sdpa_kernel(SDPBackend.MATH):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal[:t, :t], dropout_p=p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = Conv1D(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    """``forward(input_ids, labels=None) -> (logits, loss)``; ``loss`` is next-token cross-entropy when ``labels`` is given.

    As a pipeline stage: without ``transformer.wte`` the first argument is
    the previous stage's hidden states ``[b, t, n_embd]``; without
    ``lm_head`` it returns ``(hidden states, None)``. With a padded
    vocabulary (``make_vocab_size_divisible_by``) ``logits`` has
    ``padded_vocab_size`` columns, ``-inf`` at the padded ids.
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        self.tie_weights()
        # ``True`` at the padded ids (absent without padding). A buffer (``B``), which dispatch slices to the
        # logits' vocabulary split: no communication.
        padded = cfg.padded_vocab_size > cfg.vocab_size
        self.register_buffer("vocab_padding", torch.arange(cfg.padded_vocab_size) >= cfg.vocab_size if padded else None,
                             persistent=False)
        self.reset_parameters()

    def tie_weights(self) -> None:
        """``lm_head`` shares ``wte``'s weight (where this model, or stage, holds both)."""
        if self.lm_head is not None and self.transformer.wte is not None:
            self.lm_head.weight = self.transformer.wte.weight

    @torch.no_grad()
    def reset_parameters(self):
        """GPT-2's initialisation of every parameter and buffer this model, or pipeline stage of it, holds
        (``init_shard`` of the whole parameter); meta parameters and buffers are skipped."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(self.init_shard(name, tuple((0, n) for n in p.shape)))
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self):
        """The values of the buffers this model, or pipeline stage of it, holds (meta ones are skipped)."""
        for name, b in self.named_buffers():
            if b.is_meta:
                continue
            if name == "vocab_padding":
                b.copy_(torch.arange(len(b)) >= self.config.vocab_size)
            elif name.endswith(".causal"):
                b.copy_(torch.ones(b.shape, dtype=torch.bool).tril())

    def init_shard(self, name: str, box) -> torch.Tensor:
        """The box ``((start, length), ...)`` of parameter ``name``'s initial value, on the CPU (``sbp_core``'s
        contract for a parameter left on the meta device: each rank builds only its shard).

        GPT-2's initialisation: N(0, 0.02), residual projections scaled by
        1/sqrt(2 n_layer), LayerNorms 1 and biases 0. Each random parameter is
        drawn from its own generator, seeded from the global seed
        (``torch.initial_seed()``) and the parameter's name alone (the tied LM
        head's is ``transformer.wte.weight``'s), as the whole tensor draws it,
        keeping the box (``normal_box``). So any stage, or shard of a stage,
        holds the values the same parameters have in the whole model on one
        device, and a rank allocates only what it keeps (plus a block of rows
        while it draws).
        """
        param = self.get_parameter(name)
        size = tuple(n for _, n in box)
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            return torch.ones(size, dtype=param.dtype, device="cpu")
        if name.endswith(".bias"):
            return torch.zeros(size, dtype=param.dtype, device="cpu")
        scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 1.0
        key = "transformer.wte.weight" if name == "lm_head.weight" else name
        std = self.config.initializer_range * scale
        return normal_box(tuple(param.shape), box, std, _generator(key), param.dtype)

    def forward(self, input_ids, labels=None):
        t = input_ids.shape[1]
        tr = self.transformer
        x = input_ids
        if tr.wte is not None:
            # Positions 0..t-1 are the first t rows of wpe (same values and gradients as wpe(arange(t))).
            x = tr.drop(tr.wte(input_ids) + tr.wpe.weight[:t])
        for block in tr.h:
            if block is not None:
                x = block(x)
        if self.lm_head is None:
            return x, None
        logits = self.lm_head(tr.ln_f(x))
        if self.vocab_padding is not None:
            logits = logits.masked_fill(self.vocab_padding, float("-inf"))
        loss = None
        if labels is not None:
            loss = next_token_loss(logits, labels)
        return logits, loss
