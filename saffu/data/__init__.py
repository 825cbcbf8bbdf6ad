"""Data: corpus readers (``corpus``), the BabyLM download (``download``), the byte-level BPE
tokenizer (``tokenizer``), work directories of memory-mapped token streams with subsets and
samples (``workdir``) and fixed-shape windows over a stream (``windows``)."""
