"""Explicit init for the models people already train, and saffu models out to other tools.

* :mod:`saffu.interop.init` — :func:`explicit_init`: any parameter tree's embedding, output
  kernel and bias set from the explicit solution (:class:`ExplicitPieces`).
* :mod:`saffu.interop.tokens` — :class:`TokenSource`, :func:`solve_pieces`,
  :func:`solve_exact_tables`: the explicit solution from the user's own token ids.
* :mod:`saffu.interop.residual` — :class:`ExplicitResidual`: ``λ · log P_exact + apply(...)``
  for any model, inside the user's own training loop.
* :mod:`saffu.interop.weights_file` — the framework-free init file (``saffu init-weights``).
* :mod:`saffu.interop.hf` — a trained transformer as a Hugging Face GPT-2 checkpoint
  (``saffu export``).
* :mod:`saffu.interop.penzai` — :class:`~saffu.interop.penzai.PenzaiModel`: penzai's
  transformers behind saffu's model interface (``pip install -e '.[models]'``; imported by name,
  not here).
"""

from saffu.interop.init import explicit_init, tied_matrix
from saffu.interop.pieces import ExplicitPieces
from saffu.interop.residual import ExplicitResidual
from saffu.interop.tokens import TokenSource, solve_exact_tables, solve_pieces, workdir_from_tokens
from saffu.interop.weights_file import read_init_file, write_init_file

__all__ = ["ExplicitPieces", "ExplicitResidual", "TokenSource", "explicit_init", "read_init_file",
           "solve_exact_tables", "solve_pieces", "tied_matrix", "workdir_from_tokens", "write_init_file"]
