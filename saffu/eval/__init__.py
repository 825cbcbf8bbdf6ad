"""Evaluation: bits per byte and perplexities (``metrics``), scoring splits and generating text
with any model (``scoring``), BLiMP (``blimp``), the n-gram baseline on work directories
(``ngram``) and attention diagnostics (``attention``)."""
