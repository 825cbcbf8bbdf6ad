"""penzai's transformers behind saffu's model interface, so saffu's trainer, scoring and
:func:`saffu.interop.explicit_init` work on a model saffu did not write
(``pip install -e '.[models]'``).

The model is a registered kind (``penzai``: :class:`saffu.configs.PenzaiConfig`, its code
:mod:`saffu.models.penzai`), so ``saffu train --model penzai`` trains one from a run spec and its
run folder reloads for ``saffu eval``, resuming and the harness. :func:`PenzaiModel` is its config
by family first. Its parameters are a plain dict ``{label: float32 array}``, which
:func:`explicit_init` addresses by label (:meth:`~saffu.configs.PenzaiConfig.selectors`)::

    from saffu.interop import explicit_init, solve_pieces
    from saffu.interop.penzai import PenzaiModel
    from saffu.models.interface import model_init
    model = PenzaiModel("llama", vocab_size=8192)
    params = model_init(model, jax.random.key(0))
    params = explicit_init(params, solve_pieces(workdir, 128), embedding_rms=1.0, **model.selectors())
"""

from __future__ import annotations

from saffu.configs import PENZAI_FAMILIES as FAMILIES
from saffu.configs import PenzaiConfig

__all__ = ["FAMILIES", "PenzaiConfig", "PenzaiModel"]


def PenzaiModel(family: str, vocab_size: int, **fields) -> PenzaiConfig:
    """The :class:`~saffu.configs.PenzaiConfig` of penzai's ``family`` (``"llama"`` or
    ``"neox"``) for ``vocab_size`` tokens and its other ``fields`` (``width``, ``layers``,
    ``heads``, ``mlp``, ``tied``, ``context_tokens``): params ``{label: float32 array}``,
    logits ``float32[B, S, V]`` of ``tokens int32[B, S]``."""
    return PenzaiConfig(vocab_size, family, **fields)
