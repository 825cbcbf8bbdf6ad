"""Explicit (closed-form) solutions: the SAFFU stack stage by stage (``saffu``) and the cipher
bigram layer and unigram model (``bigram``). Each returns the parameter pytree of its model."""
