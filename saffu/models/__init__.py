"""Models: the interface every model shares and the losses written against it
(``interface``), the SAFFU stack (``saffu``), the cipher bigram layer (``bigram``) and the
transformer baseline (``transformer``)."""
