"""N-gram models: exact sparse counts from the engine's document contexts (``counts``),
interpolated modified Kneser-Ney (``kneser_ney``) and ARPA files (``arpa``)."""
