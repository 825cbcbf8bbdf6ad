"""Explicit (closed-form) solutions: the SAFFU stack stage by stage (``stack``), the cipher
bigram layer and unigram model (``bigram``), the exact token-resolution groups (``exact``) and
their explicit low-rank factors (``factors``). Each returns the parameter pytree of its model."""
