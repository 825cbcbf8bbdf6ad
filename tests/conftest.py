"""Strict test configuration: 4 forced CPU devices (so sharded code really shards), rank
promotion errors, a compilation cache shared by the test workers and the command-line runs they
start, and small corpora built on the fly."""

import getpass
import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

# JAX's persistent compilation cache, every compilation however small: the xdist workers and the
# `saffu` processes the CLI tests start compile many of the same programs (the environment is what
# those processes read). Keyed by the program, the jax version, the backend and the compile
# options, so a hit gives the same executable; a rerun on this machine starts warm. No size limit
# for JAX to keep (its eviction locks and rescans the folder on every write): past 1 GiB the
# folder is emptied when a session starts (pytest_configure).
CACHE = {"jax_compilation_cache_dir": os.path.join(tempfile.gettempdir(), f"saffu-tests-jax-cache-{getpass.getuser()}"),
         "jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": 0}
for name, value in CACHE.items():
    os.environ.setdefault(name.upper(), str(value))
    jax.config.update(name, type(value)(os.environ[name.upper()]))


def pytest_configure(config):
    """Empty the compilation cache past 1 GiB, in the controlling process before any worker starts."""
    folder = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if not hasattr(config, "workerinput") and folder.is_dir() and \
            sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) > 1 << 30:
        shutil.rmtree(folder, ignore_errors=True)


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
