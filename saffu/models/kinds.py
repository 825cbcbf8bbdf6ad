"""What a model kind is: the record each model module registers next to its own code
(``KIND`` in :mod:`saffu.models.saffu`, :mod:`~saffu.models.transformer`,
:mod:`~saffu.models.exact`, :mod:`~saffu.models.factorised`, :mod:`~saffu.models.bigram`,
:mod:`~saffu.models.penzai`),
collected by :mod:`saffu.models.interface`, which adds the residual and models that bring their
own code. The rest of saffu asks a config's record (:func:`saffu.models.interface.kind_of`)
what the model does, rather than comparing its ``kind`` string.

A config's FLOPs and sizes are its own methods (``forward_flops``, ``context``; see
:mod:`saffu.configs`); this record holds the code that runs it and the facts callers branch on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

_never = lambda config: False


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """One model kind.

    Attributes:
      name: the ``kind`` its config records (``config.json``'s ``model.kind``).
      config: its config class.
      logits: ``(params, config, tokens int32[B, S]) -> float[B, S, V]``, position ``p``
        predicting ``p + 1``.
      init: ``(config, key) -> params``, its random init; ``None`` for a kind that is solved
        (its explicit solution is its start).
      from_fields: ``dict -> config``, a config from its ``dataclasses.asdict`` form (the
        JSON fix-ups a kind needs, e.g. lists back to tuples); default ``config(**fields)``.
      target_logits: ``(params, config, windows int32[B, R + T], context, positions) ->
        float32[B, T, V]``, predicting only ``windows[:, context:]`` at less cost than
        ``logits``; ``None``: ``logits`` sliced.
      fused_loss: ``(params, config, windows, mask, dropout, positions) -> (nll sum, count)``
        without ``B × T × V`` logits; a kind with one also takes residual dropout.
      zero_output: ``params -> params`` with the layer that produces the logits at zero (a
        residual's trainable part starts so); ``None``: cannot be a residual's base.
      positional: ``config -> bool``, whether it reads absolute positions (its predictions move
        when a document moves inside the window).
      document_local: its prediction reads only the document's own tokens and their offsets,
        never where the document sits in the window (BLiMP may pack sentences into one row).
      radius: reads ``config.radius`` rows of context, which a work directory must hold.
      depth: the config field counting its stackable blocks (``"layers"``, ``"blocks"``),
        which Inheritune inherits and grows; ``None``: not a stack.
      grows_by_solving: its next blocks can be solved explicitly on top of a trained stack.
      attention: ``(params, config, tokens) ->`` its attention maps: ``"keys"``, per layer a
        ``[B, H, S, S]`` map; ``"offsets"``, per layer ``(heads [B, S, M_h], visible)``.
      attends_by: ``"keys"`` or ``"offsets"``, the form of ``attention``'s maps.
      attends: ``config -> bool``, whether a model of this config has attention to profile.
      solve_command: the command that saves its explicit solution in a run
        (``"saffu fit"``); ``None`` for a kind whose runs keep none.
      explicit_init: ``(config, key, factors, start) -> params``: an explicit start is its
        random init from ``key`` with pieces (``start.explicit_pieces`` of a
        :class:`saffu.configs.StartConfig`) from the explicit low-rank factors of rank
        ``config.width`` (``None`` when it takes none): the transformer, penzai's models;
        ``None``: an explicit start is a saved solution.
      exact_tables: ``config -> bool``, whether it holds exact token-resolution tables, whose
        sizes come from the data (no random init; far smaller on disk than in memory).
      drop_guide: ``(params, config) -> (config, params)`` without a self-guided run's dense guide.
      alone: ``config -> config`` that reads one document alone exactly as ``config`` does and
        whose rows may hold several documents that never see each other (the transformer that
        attends across documents: the same one, document-local); ``None``: ``config`` itself.
    """

    name: str
    config: type
    logits: Callable
    init: Callable | None = None
    from_fields: Callable | None = None
    target_logits: Callable | None = None
    fused_loss: Callable | None = None
    zero_output: Callable | None = None
    positional: Callable = _never
    document_local: bool = False
    radius: bool = False
    depth: str | None = None
    grows_by_solving: bool = False
    attention: Callable | None = None
    attends_by: str | None = None
    attends: Callable = _never
    solve_command: str | None = None
    explicit_init: Callable | None = None
    exact_tables: Callable = _never
    drop_guide: Callable | None = None
    alone: Callable | None = None

    def load(self, fields: dict):
        """A config of this kind from its ``dataclasses.asdict`` form."""
        return self.from_fields(fields) if self.from_fields else self.config(**fields)
