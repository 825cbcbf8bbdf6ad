"""Data: corpus readers (``corpus``), the BabyLM download (``download``), the byte-level BPE
tokenizer (``tokenizer``), work directories of memory-mapped token streams with subsets and
samples (``workdir``), fixed-shape windows over a stream (``windows``) and the document folds
of cross-fitting (``folds``)."""
