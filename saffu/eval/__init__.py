"""Evaluation: bits per byte and perplexities (``metrics``), scoring splits and generating text
with any model (``scoring``), BLiMP (``blimp``) and the n-gram baseline on work directories
(``ngram``)."""
