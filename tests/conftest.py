"""Strict test configuration: 4 forced CPU devices (so sharded code really shards), rank
promotion errors, and small corpora built on the fly."""

import os

import jax
import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()


jax.config.update("jax_numpy_rank_promotion", "raise")

SHARED_BABYLM = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "babylm", "2023")

TINY_TRAIN = [
    "the cat sat on the mat .",
    "the dog sat on the log .",
    "a cat saw a dog .",
    "",
    "the dogs saw the cats and the cats ran .",
    "where is the cat ? the cat is on the mat .",
] * 30
TINY_DEV = ["the cat sat on the log .", "a dog saw the cats .", "where is the dog ?"] * 5


@pytest.fixture(scope="session")
def tiny_corpus_dir(tmp_path_factory):
    """A BabyLM-layout folder with two training files and one dev file."""
    root = tmp_path_factory.mktemp("tiny_corpus")
    (root / "train_10M").mkdir()
    (root / "dev").mkdir()
    half = len(TINY_TRAIN) // 2
    (root / "train_10M" / "a.train").write_text("\n".join(TINY_TRAIN[:half]) + "\n")
    (root / "train_10M" / "b.train").write_text("\n".join(TINY_TRAIN[half:]) + "\n")
    (root / "dev" / "a.dev").write_text("\n".join(TINY_DEV) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_workdir(tiny_corpus_dir, tmp_path_factory):
    from saffu import PrepareConfig, babylm_corpus, prepare
    return prepare(babylm_corpus(tiny_corpus_dir), tmp_path_factory.mktemp("tiny_work"),
                   PrepareConfig(vocab_size=280), show_progress=False)
