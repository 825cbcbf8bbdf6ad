"""A framework-free init file: the explicit pieces as ``safetensors`` with a JSON manifest.

``saffu init-weights --workdir W --rank D --out init.safetensors`` writes::

    log_unigram   float32[V]     the output bias log p(y) (add-one smoothed, counts below)
    unigram_counts int64[V]      the counted training targets n_y (p(y) = (n_y + 1) / (n + V))
    embedding     float32[V, D]  E_0, the current token's explicit embedding
    output_kernel float32[D, V]  B (logits = h B + log p(y))
    embedding_rms, output_kernel_rms  float32[1]  the pieces' root-mean-squares: multiply
                                 by (your initialiser's RMS / this) to rescale, as saffu does

and ``init.json`` beside it (also in the file's metadata under ``"saffu"``): vocabulary size,
rank, tokenizer and token-stream fingerprints, corpus, the solver's settings. Any framework
loads it: ``safetensors.numpy.load_file``, ``safetensors.torch.load_file``, …
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from saffu._io import SaffuError, atomic_write_json, probe_writable
from saffu.interop.pieces import ExplicitPieces


def init_tensors(pieces: ExplicitPieces) -> dict[str, np.ndarray]:
    """The arrays an init file holds (see the module docstring)."""
    rms = lambda x: np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))).astype(np.float32).reshape(1)
    return {"log_unigram": np.asarray(pieces.bias, np.float32),
            "unigram_counts": np.asarray(pieces.counts, np.int64),
            "embedding": np.ascontiguousarray(pieces.embedding, np.float32),
            "output_kernel": np.ascontiguousarray(pieces.output, np.float32),
            "embedding_rms": rms(pieces.embedding), "output_kernel_rms": rms(pieces.output)}


def write_init_file(pieces: ExplicitPieces, out: str | Path) -> dict:
    """Write ``out`` (``.safetensors``) and its manifest ``out`` with ``.json``; returns the manifest."""
    from safetensors.numpy import save_file
    out = Path(out)
    if out.suffix != ".safetensors":
        raise SaffuError(f"{out}: an init file's name ends in .safetensors")
    probe_writable(out, "--out")
    manifest = {"format": "saffu-init", "version": 1, "vocab_size": pieces.vocab_size, "rank": pieces.rank,
                "tensors": {k: list(v.shape) for k, v in init_tensors(pieces).items()},
                "bias": "log_unigram = log((unigram_counts + 1) / (sum(unigram_counts) + vocab_size))",
                **pieces.manifest}
    text = json.dumps(manifest, sort_keys=True)
    temporary = out.with_name(out.name + ".tmp")
    save_file(init_tensors(pieces), str(temporary), metadata={"saffu": text, "format": "np"})
    temporary.replace(out)
    atomic_write_json(out.with_suffix(".json"), manifest)
    return manifest


def read_init_file(path: str | Path) -> ExplicitPieces:
    """:class:`ExplicitPieces` back from an init file (checked against its manifest)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    path = Path(path)
    if not path.is_file():
        raise SaffuError(f"no init file {path}; write one with `saffu init-weights`")
    with safe_open(str(path), framework="np") as handle:
        metadata = handle.metadata() or {}
    if "saffu" not in metadata:
        raise SaffuError(f"{path} is not a saffu init file (no manifest in its metadata)")
    manifest = json.loads(metadata["saffu"])
    tensors = load_file(str(path))
    if tensors["embedding"].shape != (manifest["vocab_size"], manifest["rank"]):
        raise SaffuError(f"{path}: the embedding's shape {tensors['embedding'].shape} disagrees with its manifest")
    return ExplicitPieces(embedding=tensors["embedding"], output=tensors["output_kernel"], bias=tensors["log_unigram"],
                          counts=tensors["unigram_counts"], manifest=manifest)
