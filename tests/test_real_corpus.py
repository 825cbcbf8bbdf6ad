"""Real-data checks on babylm-2023-4src (../shared/data/babylm/2023): the CLI path of the
core issue, and the unigram figure against the independently measured reference."""

import json
import os

import pytest
from conftest import SHARED_BABYLM

from saffu.cli import main

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir(SHARED_BABYLM), reason="shared BabyLM corpus not present")]


@pytest.fixture(scope="module")
def babylm_workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("babylm")
    assert main(["prepare", "--corpus", SHARED_BABYLM, "--workdir", str(work), "--vocab-size", "8192",
                 "--quiet"]) == 0
    return work


def test_prepare_counts_match_the_corpus_files(babylm_workdir):
    meta = json.loads((babylm_workdir / "meta.json").read_text())
    dev = meta["splits"]["dev"]
    assert dev["bytes"] == 5_037_061                  # the 4 dev files' bytes (data README)
    assert dev["documents"] == 70_000 + 12_747 + 6_000 + 18_000
    assert meta["vocab_size"] == 8192 and meta["splits"]["train_10M"]["replaced_bytes"] == 0


def test_unigram_and_explicit_bigram_on_dev(babylm_workdir, tmp_path):
    unigram, bigram = tmp_path / "u.json", tmp_path / "b.json"
    assert main(["stats", "--workdir", str(babylm_workdir), "--model", "unigram", "--quiet",
                 "--metrics-json", str(unigram)]) == 0
    assert main(["stats", "--workdir", str(babylm_workdir), "--model", "bigram", "--quiet",
                 "--metrics-json", str(bigram)]) == 0
    u, b = json.loads(unigram.read_text()), json.loads(bigram.read_text())
    assert u["dev_bpb"] == pytest.approx(2.67, abs=0.02)   # reference: unigram 2.67 bits/byte
    assert b["dev_bpb"] < u["dev_bpb"] - 0.3                # the cipher bigram must use its context
    assert {"dev_loss", "dev_bpb", "dev_ppl", "seconds"} <= set(b)
