"""Every configuration of the pipeline in one light module of plain data, so their defaults are
the only defaults (the CLI reads them) and reading them never imports jax. It imports nothing
of the package but its errors: a model config names its ``kind``, and the model code of that
kind is found by :mod:`saffu.models.interface` (``model_init``, ``model_logits``).

The stages that use them re-export them (``saffu.solve.stack.SolverConfig`` is
``saffu.configs.SolverConfig``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from saffu._io import SaffuError

STRUCTURES = ("dense", "lowrank", "blockdense", "blockshuffle")   # dense-layer structures, saffu.models.structured


def _blocks_divide(structure: str, n_in: int, n_out: int, blocks: int, outputs: bool) -> None:
    """One error line unless ``blocks`` divides the layer's input (and, ``outputs``, output) size."""
    if blocks < 1 or n_in % blocks or (outputs and n_out % blocks):
        raise SaffuError(f"{structure} needs the layer's sizes ({n_in} → {n_out}) divisible by its {blocks} blocks")


def _blockdense_size(budget: float, n_in: int, n_out: int, blocks: int) -> int:
    _blocks_divide("blockdense", n_in, n_out, blocks, outputs=False)
    return blocks * max(1, int(budget // (n_in / blocks + n_out) // blocks))


def _blockshuffle_size(budget: float, n_in: int, n_out: int, blocks: int) -> int:
    _blocks_divide("blockshuffle", n_in, n_out, blocks, outputs=True)
    return blocks * blocks * max(1, int(budget * blocks / (n_in + n_out) // (blocks * blocks)))


#: Each structure's inner size within a weight budget, ``(budget, n_in, n_out, blocks) -> size``.
_SIZE = {"dense": lambda budget, n_in, n_out, blocks: n_out,
         "lowrank": lambda budget, n_in, n_out, blocks: max(1, int(budget // (n_in + n_out))),
         "blockdense": _blockdense_size, "blockshuffle": _blockshuffle_size}


def structure_size(structure: str, n_in: int, n_out: int, share: float, blocks: int = 4) -> int:
    """The inner size of ``structure`` within ``share`` of ``n_in·n_out`` weights: the rank ``r``
    (``lowrank``; ``blockdense``, a multiple of ``blocks``) or the hidden width ``h = blocks²·c``
    (``blockshuffle``); ``n_out`` for ``dense``. At least one block's worth."""
    if structure not in _SIZE:
        raise SaffuError(f"unknown structure {structure!r}; choose from {', '.join(STRUCTURES)}")
    if not 0 < share <= 1:
        raise SaffuError(f"a structure's parameter share must be in (0, 1], not {share}")
    return _SIZE[structure](share * n_in * n_out, n_in, n_out, blocks)


def factor_shapes(structure: str, n_in: int, n_out: int, size: int, blocks: int = 4) -> dict[str, tuple[int, ...]]:
    """Shapes of ``structure``'s factors at inner size ``size`` (see :func:`structure_size`)."""
    b = blocks
    return {"dense": {"kernel": (n_in, n_out)},
            "lowrank": {"down": (n_in, size), "up": (size, n_out)},
            "blockdense": {"blocks": (b, n_in // b, size // b), "up": (size, n_out)},
            "blockshuffle": {"first": (b, n_in // b, size // b), "second": (b, size // b, n_out // b)}}[structure]


def structure_params(structure: str, n_in: int, n_out: int, share: float, blocks: int = 4) -> int:
    """Weights of ``structure`` (bias excluded) within ``share`` of a dense ``n_in × n_out`` layer."""
    size = structure_size(structure, n_in, n_out, share, blocks)
    return sum(math.prod(shape) for shape in factor_shapes(structure, n_in, n_out, size, blocks).values())


def guide_alpha(step: int, guide_steps: int) -> float | None:
    """Self-guided training's weight of the dense guide at ``step``: ``½(1 + cos(π·step/guide_steps))``
    (1 at step 0), and ``None`` from ``guide_steps`` on (the dense path is dropped)."""
    if step >= guide_steps:
        return None
    return 0.5 * (1.0 + math.cos(math.pi * step / guide_steps))


class SelfGuided:
    """Self-guided training's schedule, for a config with a ``guide_share`` (the share of the
    training steps over which a dense guide's weight ``α`` falls from 1 to 0 on a cosine)."""

    def guide_steps(self, steps: int) -> int:
        """Steps of a ``steps``-step run with the dense guide (``0`` without self-guided training)."""
        return max(1, round(self.guide_share * steps)) if self.guide_share else 0

    def step_inputs(self, step: int, steps: int) -> dict:
        """Inputs of training step ``step`` of ``steps`` besides the parameters (the trainer
        merges them into the params it passes; a change of their names recompiles the step):
        while self-guided, ``{"guide_alpha": α}`` with ``α = ½(1 + cos(π·step/guide_steps))``;
        afterwards — and without self-guided training — none, and the dense path is not computed."""
        import numpy as np
        alpha = guide_alpha(step, self.guide_steps(steps))
        return {} if alpha is None else {"guide_alpha": np.float32(alpha)}


#: ``<pad>`` and ``<eod>``: the ids before every regular token.
NUM_SPECIAL = 2
COMPUTE_DTYPES = ("float32", "bfloat16")
#: The transformer's blocks (:attr:`TransformerConfig.block`).
BLOCKS = ("gpt", "llama")
SMOOTHING_KINDS = ("dirichlet", "additive", "noise")
#: The strength each smoothing reads, which must be positive: Dirichlet's μ, the pseudo-count α.
SMOOTHING_STRENGTH = {"dirichlet": "mu", "additive": "alpha", "noise": "alpha"}
VALUE_FORMS = ("linear", "log")
#: Targets per evaluation window of every model (``eval_seq_len``; the transformer's fewer when
#: its ``max_len`` is shorter).
EVAL_SEQ_LEN = 256
#: A model's parameters: a pytree of arrays keyed by name (every module's ``Params``).
Params = dict[str, Any]
#: The official BabyLM 2023 release archive (``saffu download``).
BABYLM_2023_URL = "https://github.com/babylm/babylm.github.io/raw/main/babylm_data.zip"


def min_bits(vocab_size: int) -> int:
    """Smallest ``b`` with ``2**b − 1 ≥ vocab_size − 2`` (all regular codes distinct, non-zero)."""
    regular = max(vocab_size - NUM_SPECIAL, 1)
    return math.ceil(math.log2(regular + 1))


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """How to turn a corpus into a work directory.

    Attributes:
      vocab_size: BPE vocabulary size including ``<pad>`` and ``<eod>``.
      train_split: the split the tokenizer (and later every statistic) is trained on.
      eval_splits: further splits to tokenize if the corpus has them (``dev``, ``test``).
      min_frequency: minimum pair frequency for a BPE merge.
      allow_smaller_vocab: accept a vocabulary smaller than ``vocab_size`` when the training
        split supports no more merges (otherwise that is an error).
      max_replaced_share: a split whose share of U+FFFD replacement characters (invalid UTF-8)
        exceeds this is most likely not text: a warning, or an error with ``strict``.
      strict: make that warning an error.
    """

    vocab_size: int = 8192
    train_split: str = "train_10M"
    eval_splits: tuple[str, ...] = ("dev", "test")
    min_frequency: int = 2
    allow_smaller_vocab: bool = False
    max_replaced_share: float = 0.05
    strict: bool = False


@dataclasses.dataclass(frozen=True)
class CipherConfig:
    """Bit-cipher options.

    Attributes:
      bits: number of code bits ``b``; codes have ``K = b + 1`` coordinates.
      background: weight ``λ`` of the frequency background in ``(1 − λ) v + λ background``
        (0 keeps codes sparse; the formulation writes the code weight as ``β = 1 − λ``).
    """

    bits: int = 128
    background: float = 0.0

    @property
    def dim(self) -> int:
        return self.bits + 1


@dataclasses.dataclass(frozen=True)
class Smoothing:
    """How zero and small counts are smoothed before the log.

    Attributes:
      kind: ``"dirichlet"`` (default, prior-centred): ``(F[i, j] + μ p(j)) / (f[i] + μ)``;
        ``"additive"``: ``(F[i, j] + α) / (f[i] + Nα)``; ``"noise"``: the densifying variant —
        a fixed pseudo-random pseudo-count ``α·U(0, 1]`` added to every cell (our reading of
        the original work's noise).
      alpha: additive / noise pseudo-count.
      mu: Dirichlet prior strength.
      seed: seed of the noise.
    """

    kind: str = "dirichlet"
    alpha: float = 0.5
    mu: float = 100.0
    seed: int = 0

    def __post_init__(self):
        strength = SMOOTHING_STRENGTH.get(self.kind)
        if strength is None:
            raise SaffuError(f"unknown smoothing {self.kind!r}; choose one of {', '.join(SMOOTHING_KINDS)}")
        if not getattr(self, strength) > 0:
            raise SaffuError(f"{self.kind} smoothing needs {strength} > 0 (got {getattr(self, strength)})")


@dataclasses.dataclass(frozen=True)
class BigramConfig:
    """The cipher bigram layer (:mod:`saffu.models.bigram`) and its explicit solution.

    Like every model config it gives the trainer and the evaluators ``context``,
    ``forward_flops`` and ``fixed_params`` (parameters that are inputs, never trained: the
    codes); its logits are :func:`saffu.models.interface.model_logits`'s.

    Attributes:
      cipher: code bits and background blend.
      smoothing: smoothing of ``P(j | k)`` (Dirichlet around the unigram prior by default).
      holdout_tokens: the last tokens of the training stream, left out of the counts and
        used only to calibrate ``β`` (0 disables calibration, ``β = 1``).
      chunk_size: targets per device per accumulator step.
      vocab_size: ``V`` (only for FLOP counts; the explicit solution takes the work
        directory's).
    """

    cipher: CipherConfig = CipherConfig()
    smoothing: Smoothing = Smoothing()
    holdout_tokens: int = 100_000
    chunk_size: int = 1 << 15
    vocab_size: int = 0

    kind = "bigram"
    context = 1
    fixed_params = ("codes",)
    eval_seq_len = EVAL_SEQ_LEN

    def forward_flops(self, seq_len: int = 0) -> float:
        """Forward FLOPs per predicted token: the ``K × V`` output layer (2 per multiply-add)."""
        return 2.0 * self.cipher.dim * self.vocab_size


@dataclasses.dataclass(frozen=True)
class SolverConfig:
    """Options of the explicit solver.

    Attributes:
      smoothing: smoothing of every conditional distribution (Dirichlet around the prior).
        The default strength μ = 3000 is the one of 100, 1000, 3000 and 10000 with the lowest
        loss on the held-out training tail of babylm-2023-4src (``saffu fit --mu``; dev never
        looked at) (the figures: saffu/configs.py at revision a83a811): SAFFU's multi-group
        evidence needs far stronger smoothing than a single layer.
      holdout_tokens: training-stream tail kept out of the counts, used to calibrate
        temperatures (0: no calibration, all temperatures 1).
      chunk_size: targets per device per accumulator step.
      calibration_iterations: Newton / L-BFGS iterations per block (at most).
    """

    smoothing: Smoothing = Smoothing(mu=3000.0)
    holdout_tokens: int = 16_384
    chunk_size: int = 1 << 12
    calibration_iterations: int = 12


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Backprop options.

    Attributes:
      steps: optimizer steps; 0 means one epoch over the training split.
      batch_size: windows per step; each window has ``seq_len`` targets.
      seq_len: targets per window (plus the model's context of ``L·M`` tokens).
      learning_rate: peak of the warm-up + cosine schedule.
      warmup_steps: linear warm-up length (capped at half the run).
      weight_decay: AdamW decoupled weight decay.
      clip_norm: global gradient-norm clip.
      adam_eps: Adam's epsilon.
      eval_every: steps between dev evaluations (also at the end).
      eval_windows: dev windows (evenly spaced over the split) in periodic evaluations.
      checkpoint_every: steps between checkpoints (also at the end; 0: at the end only).
      seed: seed of the data order (and of the random init).
      freeze: parameter names (e.g. ``attention_0``) frozen until ``thaw_step``.
      thaw_step: step at which frozen parameters start training.
      on_nonfinite: a step whose loss or gradients are not finite is never applied;
        ``"stop"`` then raises (nothing non-finite reaches a checkpoint), ``"skip"`` keeps the
        previous parameters and optimizer state and goes on (skips are counted).
      log_every: steps between host reads of the training loss (the device runs ahead in
        between: no per-step synchronisation); a non-finite step is reported at the next read.
      compute_dtype: ``"float32"``, or ``"bfloat16"`` for the forward and backward passes
        (the parameters, the optimizer state and the loss stay float32).
      dropout: the transformer's residual dropout in training steps (on the embedded input and
        on every block's attention and MLP outputs; 0: none; evaluation never drops).
      words_unit: the parameters are also kept when the whitespace words of training text
        consumed first reach 1, 2, …, 10 and then every 10 × ``words_unit`` (BabyLM's
        checkpoints: ``1_000_000``; an explicit start's statistics pass counts as one pass over
        the data; 0: none), in ``RUN/words`` (:mod:`saffu.training.checkpoints`).
      tensorboard: also write every evaluation's figures as TensorBoard event files in
        ``RUN/tensorboard`` (the ``tensorboard`` extra: tensorboardX).
    """

    steps: int = 0
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    adam_eps: float = 1e-8
    eval_every: int = 100
    eval_windows: int = 256
    checkpoint_every: int = 200
    seed: int = 0
    freeze: tuple[str, ...] = ()
    thaw_step: int = 0
    on_nonfinite: str = "stop"
    log_every: int = 20
    compute_dtype: str = "float32"
    dropout: float = 0.0
    words_unit: int = 1_000_000
    tensorboard: bool = False

    def __post_init__(self):
        if self.words_unit < 0:
            raise SaffuError(f"words_unit must be ≥ 0 (0: no checkpoints by words seen), got {self.words_unit}")
        if not 0.0 <= self.dropout < 1.0:
            raise SaffuError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise SaffuError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise SaffuError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if self.log_every < 1:
            raise SaffuError(f"log_every must be at least 1, got {self.log_every}")
        if self.eval_every < 1 or self.checkpoint_every < 0:
            raise SaffuError(f"eval_every must be at least 1 and checkpoint_every at least 0 (0: at the end only), "
                             f"got {self.eval_every} and {self.checkpoint_every}")


@dataclasses.dataclass(frozen=True)
class SaffuConfig:
    """Architecture of a SAFFU stack (the model is :mod:`saffu.models.saffu`).

    Attributes:
      vocab_size: ``V``.
      bits: cipher bits ``b``; rows are ``K = b + 1``-dim distributions.
      radius: context rows ``M`` per block (the head included).
      heads: attention heads; head ``h`` attends over ``max(1, M >> h)`` rows.
      positions: nearest rows with their own output group (direct output only), ``≤ M``.
      hidden: ``0`` for the direct output layer, else the hidden width ``D`` of the chain.
      value_form: ``"linear"`` or ``"log"``.
      blocks: number of stacked blocks ``L``.
      exact_positions: the nearest rows whose output group reads exact token identity instead of
        the cipher code (direct form, one block): group ``p`` is then ``β_p · L_p[x_{t−p}, :]``,
        the exact offset table of :mod:`saffu.models.exact` (Witten-Bell, ``κ = 2``), stored
        sparsely and never trained; ``()`` (the default) is the all-cipher SAFFU.
      chain: the chain's dense layers ``W_1`` and ``W_2`` (``hidden > 0``): ``dense``, or a structure
        of :mod:`saffu.models.structured` (``lowrank``, ``blockdense``, ``blockshuffle``) held as
        ``hidden_factors`` / ``output_factors``, set by SVD from the dense layers (random, or the
        explicit solution's: a closed-form structured init).
      chain_share: each structured layer's weights as a share of the dense layer's.
      chain_blocks: blocks of ``blockdense`` / ``blockshuffle`` (``K = 129`` is ``3 · 43``).
    """

    vocab_size: int
    bits: int = 128
    radius: int = 8
    heads: int = 1
    positions: int = 2
    hidden: int = 0
    value_form: str = "linear"
    blocks: int = 1
    exact_positions: tuple[int, ...] = ()
    chain: str = "dense"
    chain_share: float = 0.32
    chain_blocks: int = 3
    kind: str = "saffu"
    fixed_params = ("codes",)

    def __post_init__(self):
        if self.bits < min_bits(self.vocab_size):
            raise SaffuError(f"--bits {self.bits} is too few for {self.vocab_size} tokens; "
                             f"use at least {min_bits(self.vocab_size)}")
        if self.radius < 1 or self.heads < 1 or self.blocks < 1 or self.hidden < 0:
            raise SaffuError("radius, heads and blocks must be ≥ 1 and hidden ≥ 0")
        if self.hidden == 0 and not 0 <= self.positions <= self.radius:
            raise SaffuError(f"--positions {self.positions} must be between 0 and the radius {self.radius}")
        if self.value_form not in VALUE_FORMS:
            raise SaffuError(f"unknown value form {self.value_form!r}; choose one of {', '.join(VALUE_FORMS)}")
        if self.exact_positions:
            if self.hidden or self.blocks != 1:
                raise SaffuError("exact features need the direct output layer (--hidden 0) and one block")
            if len(set(self.exact_positions)) != len(self.exact_positions) or not all(
                    0 <= p < self.positions for p in self.exact_positions):
                raise SaffuError(f"--exact-positions {' '.join(map(str, self.exact_positions))} must be distinct "
                                 f"positions below --positions {self.positions}")
        if self.chain != "dense":
            if not self.hidden:
                raise SaffuError(f"--chain-structure {self.chain} structures the chain's layers: it needs --hidden D")
            for shape in self.chain_shapes.values():
                structure_size(self.chain, *shape, self.chain_share, self.chain_blocks)

    @property
    def chain_shapes(self) -> dict[str, tuple[int, int]]:
        """The chain's dense layers: ``hidden`` ``((H + 1)·K, D)`` and ``output`` ``(D, V)``."""
        return {"hidden": ((self.heads + 1) * self.dim, self.hidden), "output": (self.hidden, self.vocab_size)}

    def chain_size(self, layer: str) -> int:
        """Rank / hidden width of the structured chain layer ``layer`` (``hidden`` or ``output``)."""
        return structure_size(self.chain, *self.chain_shapes[layer], self.chain_share, self.chain_blocks)

    @property
    def dim(self) -> int:
        return self.bits + 1

    def head_radius(self, head: int) -> int:
        return max(1, self.radius >> head)

    @property
    def groups(self) -> int:
        """Output groups of the direct form: ``positions`` rows, then one value per head."""
        return self.positions + self.heads

    @property
    def cipher_positions(self) -> tuple[int, ...]:
        """The position groups that read cipher codes (the others read exact tokens)."""
        return tuple(p for p in range(self.positions) if p not in self.exact_positions)

    @property
    def cipher_groups(self) -> int:
        """Output groups with cipher weights ``W_g``: cipher positions, then one value per head."""
        return len(self.cipher_positions) + self.heads

    @property
    def exact_config(self) -> ExactConfig:
        """The exact part (one single-token group per exact position, one temperature each)."""
        return ExactConfig(self.vocab_size, groups=tuple((p,) for p in self.exact_positions), buckets=(),
                           nested=False, smoothing="witten_bell", holdout_tokens=0)

    @property
    def context(self) -> int:
        """Tokens of left context a prediction can depend on (``L · M``)."""
        return self.blocks * self.radius

    @property
    def eval_seq_len(self) -> int:
        """Targets per evaluation window."""
        return EVAL_SEQ_LEN

    def forward_flops(self, seq_len: int = 0) -> float:
        """Analytic forward FLOPs per predicted token (2 per multiply-add): per block the
        attention similarities, scores and values of every head, the output layer, and for
        every block below the top the expected next code ``softmax(logits) · C``. Softmaxes
        and lookups are omitted; ``seq_len`` is unused (the cost does not grow with it)."""
        K, V = self.dim, self.vocab_size
        attention = sum(2 * (2 * self.head_radius(h) * K + self.head_radius(h) ** 2) for h in range(self.heads))
        output = 2 * self.cipher_groups * K * V if self.hidden == 0 else 2 * sum(
            structure_params(self.chain, *shape, self.chain_share, self.chain_blocks)
            for shape in self.chain_shapes.values())
        exact = 2 * len(self.exact_positions) * V          # each exact group: a V-wide row, scaled and added
        return float(self.blocks * (attention + output) + exact + (self.blocks - 1) * 2 * V * K)


@dataclasses.dataclass(frozen=True)
class ExactConfig:
    """The token-resolution explicit model (:mod:`saffu.models.exact`, solved by
    :mod:`saffu.solve.exact`): exact-token context groups combined log-linearly,

        ``logits(y) = log p(y) + Σ_g β_g[bucket(n(c_g))] · L_g[c_g, y]``,
        ``L_g[c, y] = log P_g(y | c) − log p(y)``, Dirichlet-smoothed around the unigram ``p``
        (or, ``nested``, around the conditional of the group it extends).

    Attributes:
      vocab_size: ``V``.
      groups: one tuple of context offsets per group (``δ = 0`` is the token right before the
        target, ``δ = 1`` the one before it, …): ``(0,)`` the bigram, ``(1,)`` a skip-bigram,
        ``(0, 1)`` the previous two tokens (a conjunction: a trigram context).
      mu: ``"witten_bell"``: the scale ``κ`` of ``μ_c = κ · t(c)``; ``"dirichlet"``: the
        strength ``μ`` of every context.
      smoothing: ``"dirichlet"`` (one ``μ`` for every context) or ``"witten_bell"`` (a
        context's strength grows with ``t(c)``, the distinct targets seen after it: a context
        followed by many different tokens leaves more mass to the distribution it is smoothed
        towards, as Kneser-Ney's discounts do); or ``"kneser_ney"``: groups smoothed towards
        another (``nested``) use interpolated modified Kneser-Ney — discounts ``D1, D2, D3+``
        per group from its count-of-counts, back-off mass ``Σ_y D(n(c, y)) / n(c)`` — and a
        nested group that is itself a parent counts continuations ``N1+(• c y)`` (distinct
        extensions seen in its child's rows) instead of raw counts; groups smoothed towards the
        unigram keep Witten-Bell ``κ · t(c)``; the chain's root (``(0,)``) is smoothed towards
        the continuation unigram ``N1+(• y)`` and its rows carry ``log(p_cont / p)``, stored once
        as the group's shift (its rows stay sparse). The defaults, ``kneser_ney`` with ``κ = 2``,
        had the lowest held-out training loss on babylm-2023-4src against Witten-Bell at
        ``κ`` = 1, 2, 4 and Dirichlet (the figures: saffu/configs.py at revision a83a811).
      buckets: lower edges of the context-count buckets after the first (contexts seen fewer
        than ``buckets[0]`` times are bucket 0); each group has one temperature per bucket
        (``()``: one temperature per group).
      bucket_by: ``None``: a group's bucket is its own context's count; ``i``: every group's
        bucket is the count of group ``i``'s context (say the longest conjunction), so how much
        each group is trusted depends on how well the most specific context is known — the
        log-linear counterpart of Kneser-Ney's backoff weights.
      nested: a group whose offsets extend another group's (``(0, 1)`` extends ``(0,)``) is
        smoothed towards that group's conditional instead of the unigram (hierarchical
        Dirichlet): ``P_g(y | c) = (n(c, y) + μ P_parent(y | c')) / (n(c) + μ)`` and
        ``L_g = log P_g − log P_parent``, so with every ``β = 1`` the nested chain is exactly the
        smoothed longest-context model, and summed groups no longer count shared evidence twice.
      holdout_tokens: whole training documents (from evenly spaced blocks of the split) kept
        out of the counts to calibrate the temperatures.
      calibration_iterations: Newton iterations (at most).
      chunk_size: targets per step when counting.
    """

    vocab_size: int
    groups: tuple[tuple[int, ...], ...] = ((0,), (1,), (2,), (3,), (0, 1), (0, 1, 2))
    mu: float = 2.0
    buckets: tuple[int, ...] = (3, 10, 30, 100, 1000, 10000)
    bucket_by: int | None = None
    nested: bool = True
    smoothing: str = "kneser_ney"
    holdout_tokens: int = 32_768
    calibration_iterations: int = 10
    chunk_size: int = 1 << 16
    kind: str = "exact"

    def __post_init__(self):
        if not self.groups or any(not g or min(g) < 0 or len(set(g)) != len(g) for g in self.groups):
            raise SaffuError(f"exact groups must be non-empty tuples of distinct offsets ≥ 0, got {self.groups}")
        if not self.mu > 0:
            raise SaffuError(f"Dirichlet smoothing needs mu > 0 (got {self.mu})")
        if list(self.buckets) != sorted(set(self.buckets)) or any(b < 2 for b in self.buckets):
            raise SaffuError(f"bucket edges must be increasing counts ≥ 2, got {self.buckets}")
        if self.smoothing not in ("dirichlet", "witten_bell", "kneser_ney"):
            raise SaffuError(f"exact smoothing must be 'dirichlet', 'witten_bell' or 'kneser_ney', "
                             f"got {self.smoothing!r}")
        if self.bucket_by is not None and not 0 <= self.bucket_by < len(self.groups):
            raise SaffuError(f"bucket_by {self.bucket_by} is not a group index (0 … {len(self.groups) - 1})")

    @property
    def context(self) -> int:
        """Tokens of left context a prediction reads: the largest offset + 1."""
        return max(max(g) for g in self.groups) + 1

    @property
    def num_buckets(self) -> int:
        return len(self.buckets) + 1

    @property
    def eval_seq_len(self) -> int:
        """Targets per evaluation window."""
        return EVAL_SEQ_LEN

    def forward_flops(self, seq_len: int = 0) -> float:
        """Per predicted token: the context searches are ~free; every group adds a ``V``-wide row
        (its constant, a dense row or a sparse scatter), then the softmax: ``(G + 1) · V``."""
        return float((len(self.groups) + 1) * self.vocab_size)


@dataclasses.dataclass(frozen=True)
class FactorisedConfig(SelfGuided):
    """The factorised explicit model, a SAFFU variant on explicit embeddings (the model is
    :mod:`saffu.models.factorised`, its explicit solution :mod:`saffu.solve.factors`)::

        h = Σ_{p < positions} E_p[x_{t−p}] + Σ_h u_h G_h,    logits = b + h B

    ``E_p`` (``V × r``) are per-offset explicit embeddings and ``B`` (``r × V``) the shared output
    factor — the rank-``r`` factorisation of the stacked exact offset matrices; ``u_h`` is SAFFU
    attention (``softmax(X x_h W_A)``, no projections) over the ``E_0`` rows of the last
    ``max(1, radius >> h)`` tokens, mapped into the factor space by ``G_h`` (``r × r``, zero in the
    explicit solution, so attention only starts to count once training moves it).

    Attributes:
      vocab_size: ``V``.
      rank: ``r``, the width of the embeddings and of the output factor.
      positions: nearest tokens with their own embedding table (offsets ``0 … positions − 1``).
      radius: tokens the attention heads read (the head included).
      heads: attention heads (``0``: none).
      output: the output factor ``B``: ``dense``, or a structure of :mod:`saffu.models.structured`
        (``lowrank``, ``blockdense``, ``blockshuffle``) held as ``params["output_factors"]``.
      output_share: a structured ``B``'s weights as a share of the dense ``r × V`` (ignored for dense).
      output_blocks: blocks of ``blockdense`` / ``blockshuffle``.
      guide_share: self-guided training of a structured ``B``: the dense ``B`` it was set from
        (``params["output_guide"]``: the explicit solution's, or a random one) is mixed in with
        weight ``α`` falling from 1 to 0 on a cosine over this share of the steps (``0``: none),
        so an explicit run starts as the dense explicit model; see :meth:`step_inputs`.
    """

    vocab_size: int
    rank: int = 96
    positions: int = 3
    radius: int = 8
    heads: int = 1
    output: str = "dense"
    output_share: float = 0.32
    output_blocks: int = 4
    guide_share: float = 0.0
    kind: str = "factorised"

    def __post_init__(self):
        if self.rank < 1 or self.positions < 1 or self.heads < 0 or self.radius < 1:
            raise SaffuError("factorised models need rank ≥ 1, positions ≥ 1, radius ≥ 1 and heads ≥ 0")
        if self.rank > self.vocab_size:
            raise SaffuError(f"--rank {self.rank} exceeds the vocabulary ({self.vocab_size})")
        structure_size(self.output, self.rank, self.vocab_size, self.output_share, self.output_blocks)
        if not 0 <= self.guide_share <= 1:
            raise SaffuError(f"--self-guided {self.guide_share} must be a share of training in [0, 1]")
        if self.guide_share and self.output == "dense":
            raise SaffuError("self-guided training needs a structured --output-structure (a dense B has nothing "
                             "to guide)")

    def head_radius(self, head: int) -> int:
        return max(1, self.radius >> head)

    @property
    def context(self) -> int:
        """Tokens of left context a prediction reads."""
        return max(self.positions, self.radius if self.heads else 0)

    @property
    def eval_seq_len(self) -> int:
        """Targets per evaluation window."""
        return EVAL_SEQ_LEN

    def forward_flops(self, seq_len: int = 0) -> float:
        """Per predicted token: the output factor ``2 r V`` (dense; twice its weights structured;
        the embedding sums are lookups),
        per head the similarities, scores and value over its radius and ``G_h`` (``2 r²``)."""
        r = self.rank
        attention = sum(2 * (2 * self.head_radius(h) * r + self.head_radius(h) ** 2) + 2 * r * r
                        for h in range(self.heads))
        output = structure_params(self.output, r, self.vocab_size, self.output_share, self.output_blocks)
        return float(2 * output + attention)

    def step_forward_flops(self, seq_len: int, inputs: dict) -> float:
        """:meth:`forward_flops` of a step with these :meth:`step_inputs`: the guided steps also
        run the dense guide ``B`` (``2 r V``) and mix the two outputs (``3 V``)."""
        flops = self.forward_flops(seq_len)
        if "guide_alpha" in inputs:
            flops += 2.0 * self.rank * self.vocab_size + 3.0 * self.vocab_size
        return flops


@dataclasses.dataclass(frozen=True)
class FactorConfig:
    """How :func:`saffu.solve.factors.solve_factorised` finds the explicit factors.

    Attributes:
      mu: Witten-Bell scale ``κ`` of the exact offset groups (``μ_c = κ · t(c)``, smoothed towards
        the unigram), as :class:`ExactConfig`.
      column_power: columns (targets ``y``) of the stacked matrix weighted by ``p(y)^a`` before
        the SVD (rows by ``√n(c)``): a rare target's large log-ratio stops dominating the
        squared error (``0``: unweighted). ``0.5`` was picked on held-out training data
        (the figures: saffu/configs.py at revision a83a811).
      oversample, power_iterations, seed: of the randomized SVD
        (:func:`saffu.solve.factors.randomized_svd`). One subspace iteration before the
        refinement steps scores as well as two, and costs less.
      buckets: context-count bucket edges of the temperatures (one per offset and bucket, folded
        into the embeddings), as :class:`ExactConfig`.
      holdout_tokens: whole training documents kept out of the counts to calibrate the
        temperatures (Newton; convex). The calibration costs about one scoring pass over them
        per Newton step, so the default is the fewest that lost nothing against more.
      calibration_iterations: Newton iterations (at most) on a quarter of the held-out tokens.
      final_iterations: Newton iterations (at most) on all of them from there. One reached the
        held-out loss of three with a pass over the held-out tokens fewer; none was worse.
      refine_steps: Adam steps of the SVD's factors on the softmax cross-entropy against each
        refined offset's smoothed conditionals (:func:`saffu.solve.factors.refine_factors`; ``0``:
        the SVD's factors as they are).
      refine_offsets: the first offsets whose rows of ``E`` move in those steps (``B`` always
        does; the other offsets keep the SVD's rows). Each costs ``3 V² r`` multiply-adds per step.
      refine_learning_rate, refine_momentum: Adam's rate and ``b1`` for those steps.

        Picked on babylm-2023-4src (rank 96, 3 offsets) by the held-out training tokens' loss
        within the cost goal (the whole solve at most a twentieth of a warm epoch)
        (the figures: saffu/configs.py at revision a83a811).
      chunk_size: targets per counting step.
    """

    mu: float = 2.0
    column_power: float = 0.5
    oversample: int = 16
    power_iterations: int = 1
    seed: int = 0
    buckets: tuple[int, ...] = (3, 10, 30, 100, 1000, 10000)
    holdout_tokens: int = 4_096
    calibration_iterations: int = 10
    final_iterations: int = 1
    refine_steps: int = 6
    refine_offsets: int = 1
    refine_learning_rate: float = 0.07
    refine_momentum: float = 0.5
    chunk_size: int = 1 << 16

    def __post_init__(self):
        if list(self.buckets) != sorted(set(self.buckets)) or any(b < 2 for b in self.buckets):
            raise SaffuError(f"bucket edges must be increasing counts ≥ 2, got {self.buckets}")
        if not self.mu > 0 or self.column_power < 0 or self.oversample < 0 or self.power_iterations < 0:
            raise SaffuError("factor solve needs mu > 0 and column_power, oversample, power_iterations ≥ 0")
        if self.calibration_iterations < 0 or self.final_iterations < 0:
            raise SaffuError("calibration_iterations and final_iterations must be ≥ 0")
        if (self.refine_steps < 0 or self.refine_offsets < 1 or not self.refine_learning_rate > 0
                or not 0 <= self.refine_momentum < 1):
            raise SaffuError("refine_steps must be ≥ 0, refine_offsets ≥ 1, refine_learning_rate > 0 and "
                             "refine_momentum in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TransformerConfig(SelfGuided):
    """Architecture of the baseline (the model is :mod:`saffu.models.transformer`).

    Attributes:
      vocab_size: ``V``.
      width: model width ``d``.
      layers: transformer blocks.
      heads: attention heads (``d`` must divide by it).
      mlp_ratio: MLP hidden width ``= mlp_ratio · d``.
      context_tokens: left context before a window's targets (``context``).
      max_len: longest window ``context + seq_len`` the learned positions cover.
      ffn: the MLP's two layers (``mlp_in``, ``mlp_out``): ``dense``, or a structure of
        :mod:`saffu.models.structured` (``lowrank``, ``blockdense``, ``blockshuffle``).
      ffn_share: a structured layer's weights as a share of the dense layer's (ignored for dense).
      ffn_blocks: blocks of ``blockdense`` / ``blockshuffle``.
      guide_share: self-guided training: the share of the training steps over which a dense
        guide's weight ``α`` falls from 1 to 0 on a cosine (``0``: no guide); see :meth:`step_inputs`.
      output_bias: the output layer has a bias (default ``False``: logits ``= h B`` alone, the
        layout ``saffu export`` writes as a Hugging Face checkpoint; see ``results/tuning.json``).
      block: ``"llama"`` (the default: RMSNorm, projections without biases, a SwiGLU MLP of
        :attr:`mlp_hidden` units, rotary positions on queries and keys, no position table) or
        ``"gpt"`` (LayerNorm, biased projections, a GELU MLP, learned absolute positions;
        structured MLPs and self-guided training are its own); the output
        layer's bias follows ``output_bias`` in both.
      across_documents: attention also sees the earlier documents of a window (the default: a
        causal mask that never reads ``<pad>``, as Hugging Face's, so an exported run's logits
        equal saffu's on any unpadded input; BabyLM's documents are lines, often of one
        conversation, and reading them as context lowers both starts' dev figures,
        ``results/tuning.json``); ``False``: a position sees its own document only, as the SAFFU
        windows do. Runs saved before this default are ``False``.
    """

    vocab_size: int
    width: int = 128
    layers: int = 5
    heads: int = 4
    mlp_ratio: int = 4
    context_tokens: int = 32
    max_len: int = 512
    ffn: str = "dense"
    ffn_share: float = 0.32
    ffn_blocks: int = 4
    guide_share: float = 0.0
    output_bias: bool = False
    block: str = "llama"
    across_documents: bool = True
    kind: str = "transformer"

    def __post_init__(self):
        if self.block not in BLOCKS:
            raise SaffuError(f"block must be one of {', '.join(BLOCKS)}, got {self.block!r}")
        if self.block == "llama" and (self.ffn != "dense" or self.guide_share):
            raise SaffuError("the llama block has a dense SwiGLU MLP; --ffn structures and --self-guided are the "
                             "gpt block's")
        if self.block == "llama" and (self.width // max(self.heads, 1)) % 2:
            raise SaffuError(f"rotary positions need an even head width; --width {self.width} / --attention-heads "
                             f"{self.heads} is odd")
        if min(self.width, self.layers, self.heads, self.mlp_ratio, self.max_len) < 1 or self.context_tokens < 1:
            raise SaffuError("transformer width, layers, heads, mlp_ratio, max_len and context must be ≥ 1")
        if self.width % self.heads:
            raise SaffuError(f"--width {self.width} must be a multiple of --heads {self.heads}")
        if self.context_tokens >= self.max_len:
            raise SaffuError(f"context {self.context_tokens} must be shorter than max_len {self.max_len}")
        hidden = self.mlp_ratio * self.width
        structure_size(self.ffn, self.width, hidden, self.ffn_share, self.ffn_blocks)   # checks the structure
        structure_size(self.ffn, hidden, self.width, self.ffn_share, self.ffn_blocks)
        if not 0 <= self.guide_share <= 1:
            raise SaffuError(f"--self-guided {self.guide_share} must be a share of training in [0, 1]")
        if self.guide_share and self.ffn == "dense":
            raise SaffuError("self-guided training needs a structured --ffn (a dense MLP has nothing to guide)")

    @property
    def context(self) -> int:
        return self.context_tokens

    @property
    def eval_seq_len(self) -> int:
        """Targets per evaluation window: :data:`EVAL_SEQ_LEN`, or fewer so the window fits ``max_len``."""
        return min(EVAL_SEQ_LEN, self.max_len - self.context)

    def forward_flops(self, seq_len: int) -> float:
        """Analytic forward FLOPs per predicted token (2 per multiply-add) at window length
        ``context + seq_len``: the dense layers, attention scores and mixing over the average
        visible length, and the output layer. Embedding lookups, norms and softmaxes are omitted."""
        d, V, L = self.width, self.vocab_size, self.layers
        mean_visible = (self.context + seq_len + 1) / 2
        dense = L * (4 * d * d + self.mlp_weights)
        attention = L * 2 * mean_visible * d
        return 2.0 * (dense + attention + d * V)

    @property
    def mlp_hidden(self) -> int:
        """Units of one block's MLP: ``mlp_ratio · d`` (gpt); llama's SwiGLU has three matrices, so
        ``2/3`` of that, rounded up to a multiple of 8 (as Llama does): about the same weights."""
        if self.block == "llama":
            return -(-2 * self.mlp_ratio * self.width // 24) * 8
        return self.mlp_ratio * self.width

    @property
    def mlp_weights(self) -> int:
        """Weights (biases excluded) of one block's MLP: ``2 · mlp_ratio · d²`` dense, fewer
        structured; llama's three matrices ``3 · d · mlp_hidden``."""
        if self.block == "llama":
            return 3 * self.width * self.mlp_hidden
        hidden = self.mlp_ratio * self.width
        return (structure_params(self.ffn, self.width, hidden, self.ffn_share, self.ffn_blocks)
                + structure_params(self.ffn, hidden, self.width, self.ffn_share, self.ffn_blocks))

    def step_forward_flops(self, seq_len: int, inputs: dict) -> float:
        """:meth:`forward_flops` of a step with these :meth:`step_inputs`: the guided steps also
        run the dense guide (``2 · mlp_ratio · d²`` multiply-adds per block) and mix the two paths."""
        flops = self.forward_flops(seq_len)
        if "guide_alpha" in inputs:
            d, hidden = self.width, self.mlp_ratio * self.width
            flops += 2.0 * self.layers * (2 * d * hidden) + 3.0 * self.layers * (d + hidden)
        return flops


#: Per model kind, the fields whose default changed and their values before: a saved config
#: (``RUN/config.json``) or a spec ``saffu train`` wrote (``RUN/train.json``) names every field it
#: had, so one it lacks came later and the run had the old value (transformers saved before the
#: llama block and the mask across documents were the defaults: gpt blocks with an output bias
#: whose attention stays within a document).
SAVED_BEFORE = {"transformer": {"block": "gpt", "output_bias": True, "across_documents": False}}


#: penzai's transformers (:class:`PenzaiConfig`): its Llama-like one and its GPT-NeoX.
PENZAI_FAMILIES = ("llama", "neox")


@dataclasses.dataclass(frozen=True)
class PenzaiConfig:
    """A transformer that penzai builds (the model is :mod:`saffu.models.penzai`; ``pip install
    -e '.[models]'``): params ``{label: float32 array}`` by penzai's parameter labels (the named
    axes in penzai's order), neither family with an output bias. The default size is the
    project's transformer's (width 128, 5 blocks, 4 heads of 32, 32 tokens of context).

    Attributes:
      vocab_size: ``V``.
      family: ``llama`` (penzai's Llama-like: RMSNorm, RoPE, SwiGLU) or ``neox`` (GPT-NeoX:
        LayerNorm, parallel attention and MLP, partial RoPE, GELU).
      width: the model width ``d``.
      layers: decoder blocks.
      heads: attention heads (each ``d / heads`` wide).
      mlp: the MLP's hidden width (the Llama-like SwiGLU takes two thirds of it, so its weights
        match a plain MLP's).
      tied: one matrix for the embeddings and the output (penzai scales it by ``√d`` on the way
        in; ``llama`` only).
      context_tokens: left context before a window's targets when training and scoring.
    """

    vocab_size: int
    family: str = "llama"
    width: int = TransformerConfig.width
    layers: int = TransformerConfig.layers
    heads: int = TransformerConfig.heads
    mlp: int = 512
    tied: bool = False
    context_tokens: int = TransformerConfig.context_tokens
    kind: str = "penzai"

    def __post_init__(self):
        if self.family not in PENZAI_FAMILIES:
            raise SaffuError(f"penzai family must be one of {', '.join(PENZAI_FAMILIES)}, got {self.family!r}")
        if self.tied and self.family != "llama":
            raise SaffuError("a tied matrix is penzai's Llama-like option; GPT-NeoX is untied")
        if min(self.width, self.layers, self.heads, self.mlp, self.context_tokens) < 1:
            raise SaffuError("penzai width, layers, heads, mlp and context must be ≥ 1")
        if self.width % self.heads:
            raise SaffuError(f"width {self.width} must be a multiple of heads {self.heads}")

    @property
    def context(self) -> int:
        return self.context_tokens

    @property
    def eval_seq_len(self) -> int:
        return EVAL_SEQ_LEN

    def forward_flops(self, seq_len: int) -> float:
        """Multiply-add FLOPs (×2) per predicted token of a window of ``seq_len`` targets: the
        blocks' projections and MLP, attention over the average visible length, the output layer."""
        d, L, V = self.width, self.layers, self.vocab_size
        mean_visible = (self.context + seq_len + 1) / 2
        mlp = 3 * d * (self.mlp * 2 // 3) if self.family == "llama" else 2 * d * self.mlp
        return 2.0 * (L * (4 * d * d + mlp + 2 * mean_visible * d) + d * V)

    def selectors(self) -> dict[str, str]:
        """The labels of the leaves an explicit init sets, as :func:`saffu.interop.explicit_init`'s
        keyword arguments: the embeddings ``[V, d]`` and, untied, the output kernel ``[d, V]``."""
        if self.tied:
            return {"embedding": PENZAI_EMBEDDING}
        return {"embedding": PENZAI_EMBEDDING, "output": PENZAI_OUTPUT}


#: The labels of a penzai model's token embeddings ``[V, d]`` (also its output, tied) and of
#: its untied output kernel ``[d, V]``.
PENZAI_EMBEDDING, PENZAI_OUTPUT = "transformer/embedder.embeddings", "transformer/lm_head.weights"

RESIDUAL_SCALES = ("fixed", "learned", "annealed")
#: Blocks of whole documents a training stream is cut into for cross-fitting (block b is in
#: fold b mod K; :mod:`saffu.data.folds`).
FOLD_BLOCKS = 64

#: What an explicit init of the transformer takes from the explicit low-rank factors
#: (:func:`saffu.models.transformer.explicit_transformer_init`).
EXPLICIT_PIECES = ("bias", "embeddings", "output")
#: Closed forms of one matrix that is both the token embedding and the output kernel
#: (:func:`saffu.models.penzai.tied_matrix`): ``E_0``, ``Bᵀ``, or the two at equal RMS averaged.
TIED_CHOICES = ("embedding", "output", "mean")


@dataclasses.dataclass(frozen=True)
class ResidualConfig:
    """A model that learns a residual over a fixed explicit model (the model is
    :mod:`saffu.models.residual`)::

        logits = λ · log P_explicit(y | context) + f_θ(context)

    ``f_θ`` is any trainable model (the transformer, SAFFU, the factorised model) whose output
    layer starts at zero, so step 0 is exactly the explicit model; ``P_explicit`` is the exact
    token-resolution model (:class:`ExactConfig`), loaded from its run and never trained.

    Attributes:
      base: the trainable model's config (``f_θ``).
      explicit: the explicit model's config.
      explicit_run: run directory holding the explicit solution (``saffu exact --run``).
      scale: ``"fixed"`` (``λ`` stays ``scale_init``), ``"learned"`` (``λ`` is trained) or
        ``"annealed"``: ``λ`` falls from ``scale_init`` to 0 on a cosine over the first
        ``anneal_share`` of the training steps, then the explicit part is dropped — the trained
        model is ``f_θ`` alone (no sparse lookup at inference), which leaned on the explicit
        model early on. ``λ`` is then a per-step input (:meth:`step_inputs`), not a parameter.
      scale_init: ``λ`` at step 0.
      anneal_share: with ``"annealed"``, the share of the training steps over which ``λ`` falls.
      explicit_sha256: content fingerprint of the explicit tables the run was made over
        (:func:`saffu._io.tree_fingerprint`); loading refuses other tables ("" : not checked,
        runs saved before it was recorded).
      folds: cross-fitting (``K ≥ 2``; 0: none). The training split is cut into
        ``fold_blocks`` blocks of whole documents, block ``b`` in fold ``b mod K``
        (:mod:`saffu.data.folds`); training step ``s`` draws its windows from fold ``s mod K``
        only, and its explicit part is the exact model solved without that fold
        (``fold_runs[k]``), so the trainable part never learns to lean on tables that counted
        its own targets. Evaluation, BLiMP and generation use ``explicit_run``, the exact model
        of the whole split.
      fold_blocks: blocks of the fold assignment.
      fold_runs: with ``folds``, the exact run of each fold's complement, in fold order.
      fold_sha256: their content fingerprints (as ``explicit_sha256``).
    """

    base: Any
    explicit: ExactConfig
    explicit_run: str
    scale: str = "fixed"
    scale_init: float = 1.0
    anneal_share: float = 0.5
    kind: str = "residual"
    explicit_sha256: str = ""
    folds: int = 0
    fold_blocks: int = FOLD_BLOCKS
    fold_runs: tuple[str, ...] = ()
    fold_sha256: tuple[str, ...] = ()

    def __post_init__(self):
        if self.scale not in RESIDUAL_SCALES:
            raise SaffuError(f"residual scale must be one of {', '.join(RESIDUAL_SCALES)}, got {self.scale!r}")
        if not 0 < self.anneal_share <= 1:
            raise SaffuError(f"the residual's anneal share must be in (0, 1], got {self.anneal_share}")
        if not isinstance(self.base, (TransformerConfig, SaffuConfig, FactorisedConfig)):
            raise SaffuError(f"the residual's trainable part must be a transformer, SAFFU or factorised model, "
                             f"got {getattr(self.base, 'kind', self.base)!r}")
        if getattr(self.base, "guide_share", 0):
            raise SaffuError("self-guided training is not wired through an explicit residual; train the residual's "
                             "structured transformer plainly (--self-guided 0)")
        if not isinstance(self.explicit, ExactConfig):
            raise SaffuError("the residual's explicit part must be an exact model (`saffu exact`)")
        if self.base.vocab_size != self.explicit.vocab_size:
            raise SaffuError(f"the trainable model has {self.base.vocab_size:,} tokens but the explicit one "
                             f"{self.explicit.vocab_size:,}")
        if self.folds == 1 or self.folds < 0 or (self.folds and len(self.fold_runs) != self.folds):
            raise SaffuError(f"a cross-fitted residual needs K ≥ 2 folds and one exact run per fold; got "
                             f"{self.folds} folds and {len(self.fold_runs)} runs")
        if self.folds and self.scale == "annealed":
            raise SaffuError("cross-fitting and an annealed λ do not go together; use --residual-scale fixed or learned")

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def context(self) -> int:
        """The longer of the two parts' contexts."""
        return max(self.base.context, self.explicit.context)

    @property
    def eval_seq_len(self) -> int:
        return self.base.eval_seq_len

    @property
    def fixed_params(self) -> tuple[str, ...]:
        """Never trained: the explicit tables, ``f_θ``'s own fixed inputs (SAFFU's codes, kept
        beside ``"model"``), and ``λ`` when it is fixed (an annealed ``λ`` is a per-step input,
        not a parameter)."""
        tables = ("explicit", "folds") if self.folds else ("explicit",)
        inputs = tables + tuple(getattr(self.base, "fixed_params", ()))      # f_θ's own inputs (SAFFU's codes)
        return inputs + ("scale",) if self.scale == "fixed" else inputs

    def anneal_steps(self, steps: int) -> int:
        """Steps of a ``steps``-step run that read the explicit model (all of them unless annealed)."""
        return max(1, round(self.anneal_share * steps)) if self.scale == "annealed" else steps

    def step_inputs(self, step: int, steps: int) -> dict:
        """Inputs of training step ``step`` of ``steps`` besides the parameters (see
        :meth:`SelfGuided.step_inputs`): annealed, ``{"scale": λ}`` with
        ``λ = scale_init · ½(1 + cos(π·step/anneal_steps))`` until ``anneal_steps``, then none,
        and the explicit part is not computed; fixed or learned, none (``λ`` is a parameter)."""
        import numpy as np
        if self.folds:                 # cross-fitted: the fold whose windows (and tables) this step uses
            return {"fold": np.int32(step % self.folds)}
        if self.scale != "annealed":
            return {}
        weight = guide_alpha(step, self.anneal_steps(steps))
        return {} if weight is None else {"scale": np.float32(self.scale_init * weight)}

    def eval_inputs(self, step: int, steps: int) -> dict:
        """Inputs of an evaluation at step ``step``: :meth:`step_inputs` without the fold (an
        evaluation uses the exact model of the whole split)."""
        return {name: value for name, value in self.step_inputs(step, steps).items() if name != "fold"}

    def forward_flops(self, seq_len: int) -> float:
        """The trained model's FLOPs at inference: the trainable model's plus the explicit
        lookup's and its log-softmax (``3V``); annealed, the trainable model's alone."""
        return self.step_forward_flops(seq_len, {} if self.scale == "annealed" else {"scale": None})

    def step_forward_flops(self, seq_len: int, inputs: dict) -> float:
        """:meth:`forward_flops` of a training step with these :meth:`step_inputs`: a step that
        reads the explicit model (``"scale"`` among its inputs, or ``λ`` a parameter) pays for it."""
        flops = self.base.forward_flops(seq_len)
        if "scale" in inputs or self.scale != "annealed":
            flops += self.explicit.forward_flops(seq_len) + 3.0 * self.vocab_size
        return flops


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """How a final evaluation scores a split (:func:`saffu.eval.scoring.evaluate_split`).

    Attributes:
      eval_tokens: score about this many tokens of each split: whole documents from evenly
        spaced parts of it, with exact bits per byte (0: whole splits).
    """

    eval_tokens: int = 200_000


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """The Kneser-Ney n-gram baseline (:mod:`saffu.ngram.kneser_ney`).

    Attributes:
      order: n-gram order, 1 to 9.
    """

    order: int = 5

    def __post_init__(self):
        if not 1 <= self.order <= 9:
            raise SaffuError(f"--order must be between 1 and 9, got {self.order}")


@dataclasses.dataclass(frozen=True)
class InspectConfig:
    """Attention diagnostics of a run (:func:`saffu.eval.attention.inspect_attention`).

    Attributes:
      split: split whose windows are averaged.
      windows: evenly spaced windows to average over.
      seq_len: targets per window (None: the model's evaluation length).
      energy: energy threshold of the effective rank, in (0, 1].
      lazy_rank: a layer is lazy when no head's rank exceeds this.
    """

    split: str = "dev"
    windows: int = 64
    seq_len: int | None = None
    energy: float = 0.9
    lazy_rank: int = 1


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """Sampling documents from a model (:func:`saffu.eval.scoring.generate`).

    Attributes:
      num_samples: documents to sample.
      max_tokens: longest sample.
      temperature: softmax temperature (> 0).
      top_k: sample among the k most likely tokens (0: all).
      seed: sampling seed.
      prompt: text every sample continues (empty: samples start a document).
    """

    num_samples: int = 3
    max_tokens: int = 60
    temperature: float = 1.0
    top_k: int = 50
    seed: int = 0
    prompt: str = ""


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """``saffu demo``: the main job on a small corpus.

    Attributes:
      vocab_size: BPE vocabulary size.
      bits: bit-cipher bits b (64: half the solve and training time of 128 on the small demo corpus).
      steps: AdamW warm-start steps.
    """

    vocab_size: int = 512
    bits: int = 64
    steps: int = 40


#: What a step with a non-finite loss does (:attr:`TrainConfig.on_nonfinite`).
NONFINITE_ACTIONS = ("stop", "skip")
#: Smoothings of the exact model (:attr:`ExactConfig.smoothing`).
EXACT_SMOOTHINGS = ("dirichlet", "witten_bell", "kneser_ney")
#: The values a field may take, where the config restricts them (the CLI's choices).
FIELD_CHOICES = {(TransformerConfig, "block"): BLOCKS,
                 (Smoothing, "kind"): SMOOTHING_KINDS, (SaffuConfig, "value_form"): VALUE_FORMS,
                 (SaffuConfig, "chain"): STRUCTURES, (FactorisedConfig, "output"): STRUCTURES,
                 (TransformerConfig, "ffn"): STRUCTURES, (TrainConfig, "on_nonfinite"): NONFINITE_ACTIONS,
                 (TrainConfig, "compute_dtype"): COMPUTE_DTYPES, (ExactConfig, "smoothing"): EXACT_SMOOTHINGS,
                 (ResidualConfig, "scale"): RESIDUAL_SCALES,
                 (PenzaiConfig, "family"): PENZAI_FAMILIES}

INIT_KINDS = ("explicit", "random", "inherit")
MODEL_KINDS = ("saffu", "transformer", "factorised", "penzai")
GROW_BY = ("reference", "solve")


@dataclasses.dataclass(frozen=True)
class StartConfig:
    """How a training run starts (``saffu train``; :func:`saffu.training.recipes.start_training`).

    Attributes:
      init: explicit: warm start from --run's explicit solution (a transformer: from explicit
        low-rank factors solved here, see --explicit-pieces); random: cold start; inherit: a
        transformer or SAFFU stack from the first blocks of --reference (Inheritune)
      model: architecture of a new run (an existing run keeps its own)
      explicit_pieces: transformer or penzai --init explicit: output bias = log unigram (a model with
        one), token embeddings and output kernel from the explicit factors (rank = --width), rescaled to
        the random init's scale; none: the random init, its embeddings at --explicit-embedding-rms
        (the scale ablation)
      explicit_embedding_rms: transformer or penzai --init explicit: the embeddings' root-mean-square
        (default: the random init's; 1.0: the scale a norm layer outputs, which the budget sweep
        measured against the default)
      explicit_output_rms: transformer or penzai --init explicit: the explicit output kernel's
        root-mean-square (default: the random init's, ``1/√d`` for flax's initialiser; penzai's
        Llama-like starts its output at about ``√(2 / (d + V))``)
      explicit_tied: penzai --tied --init explicit: the one matrix's closed form: embedding (E₀),
        output (Bᵀ) or mean (both at equal RMS, averaged), at --explicit-embedding-rms (default: the
        random matrix's own; it is also the output kernel)
      residual: learn a residual over the exact model of this run (`saffu exact`): logits =
        λ · log P_exact + f(context), f's output layer at zero, so step 0 is the exact model
      bundle: with --residual: copy the exact model into the run (RUN/exact), so it survives moving
        and re-solving the exact run (`saffu pack` does it later)
      reference: --init inherit: a trained transformer run whose token embeddings, positions, first
        --inherit-layers blocks, final norm and output layer start the new run; or a SAFFU stack
        run, whose first blocks (each with its own output layer) start it
      inherit_layers: --init inherit: blocks to take (default: half the reference's, at least 1)
      inherit_before_lazy: --init inherit without --inherit-layers: take the blocks before the
        reference's first lazy layer (`saffu inspect`'s profile on 64 dev windows; half when none is lazy)
      start_from: --init inherit: grow this trained run (fewer blocks, same width) instead: all of
        its weights, then new blocks up to --inherit-layers (default: one more), see --grow-by
      grow_by: --start-from: the new blocks are the reference's next blocks, or (SAFFU) blocks
        solved explicitly on top of the trained stack, which may grow past the reference's depth
      ffn_from: start the structured transformer from this trained dense transformer run: all of
        its weights, the MLP kernels as their SVD (trained-SVD init; the guide when self-guided)
      devices: data-parallel over this many local devices of one process (0: all); the batch is
        split over them (for one process per core or per host: --num-processes)
    """

    init: str = "random"
    model: str = "saffu"
    explicit_pieces: tuple[str, ...] = EXPLICIT_PIECES
    explicit_embedding_rms: float | None = None
    explicit_output_rms: float | None = None
    explicit_tied: str = "mean"
    residual: str | None = None
    bundle: bool = False
    reference: str | None = None
    inherit_layers: int | None = None
    inherit_before_lazy: bool = False
    start_from: str | None = None
    grow_by: str = "reference"
    ffn_from: str | None = None
    devices: int = 1

    def __post_init__(self):
        for flag, value in (("embedding", self.explicit_embedding_rms), ("output", self.explicit_output_rms)):
            if value is not None and not value > 0:
                raise SaffuError(f"--explicit-{flag}-rms must be > 0, not {value}")
        if self.explicit_tied not in TIED_CHOICES:
            raise SaffuError(f"--explicit-tied must be one of {', '.join(TIED_CHOICES)}, not {self.explicit_tied!r}")


FIELD_CHOICES.update({(StartConfig, "init"): INIT_KINDS, (StartConfig, "model"): MODEL_KINDS,
                      (StartConfig, "explicit_pieces"): EXPLICIT_PIECES, (StartConfig, "grow_by"): GROW_BY,
                      (StartConfig, "explicit_tied"): TIED_CHOICES})


@dataclasses.dataclass(frozen=True)
class DeviceCheckConfig:
    """The device check's sizes, reference and tolerances (:func:`saffu.eval.device.device_check`).

    Attributes:
      train_tokens: cut the training split to about this many tokens (whole documents, seeded; default: all of it)
      dev_tokens: with --train-tokens, the dev split size of the cut
      steps: training steps per compute dtype
      batch_size: training windows per step
      seq_len: targets per training window
      eval_windows: dev windows of the dev-loss evaluation
      bits: cipher bits
      radius: offsets M (SAFFU radius)
      chunk_sizes: statistics chunk sizes
      repeats: statistics passes per chunk size, the fastest kept
      solve_chunk_size: chunk size of the solver's passes
      holdout_tokens: solver calibration holdout (at most a tenth of the training stream)
      reference: device_check.json of a reference run of the same settings (usually a CPU's)
      rtol: relative tolerance of the holdout and float32 dev losses
      bf16_rtol: relative tolerance of the bfloat16 dev loss
    """

    train_tokens: int | None = None
    dev_tokens: int = 100_000
    steps: int = 100
    batch_size: int = TrainConfig.batch_size
    seq_len: int = TrainConfig.seq_len
    eval_windows: int = TrainConfig.eval_windows
    bits: int = 128
    radius: int = 8
    chunk_sizes: tuple[int, ...] = (1 << 12, 1 << 15, 1 << 17)
    repeats: int = 2
    solve_chunk_size: int = SolverConfig.chunk_size
    holdout_tokens: int = SolverConfig.holdout_tokens
    reference: str | None = None
    rtol: float = 1e-3
    bf16_rtol: float = 1e-2

    def __post_init__(self):
        if not self.chunk_sizes or min(self.chunk_sizes) < 1:
            raise SaffuError(f"--chunk-sizes must be positive, got {self.chunk_sizes}")
        if self.steps < 1 or self.repeats < 1:
            raise SaffuError("--steps and --repeats must be at least 1")
