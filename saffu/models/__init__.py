"""Models: the interface every model shares, the kind registry (``model_init``,
``model_logits``) and the losses written against it (``interface``); the SAFFU stack
(``saffu``), the cipher bigram layer (``bigram``), the exact token-resolution model
(``exact``), the factorised model on explicit embeddings (``factorised``), the transformer
(``transformer``), the explicit residual over any of them (``residual``) and structured
drop-ins for dense layers (``structured``)."""
