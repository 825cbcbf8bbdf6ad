import json
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saffu import (
    PrepareConfig,
    SaffuError,
    babylm_corpus,
    download_babylm,
    iter_documents,
    open_workdir,
    prepare,
    text_files_corpus,
)
from saffu._io import SaffuWarning
from saffu.cli import main
from saffu.data.corpus import ReadStats
from saffu.data.tokenizer import EOD_ID, decode


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("saffu: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_missing_folder_empty_corpus_and_wrong_split(tmp_path, capsys, tiny_corpus_dir):
    err = one_line_error(capsys, ["prepare", "--corpus", str(tmp_path / "nope"), "--workdir", str(tmp_path / "w")])
    assert "does not exist" in err and "nope" in err
    (tmp_path / "empty" / "train_10M").mkdir(parents=True)
    (tmp_path / "empty" / "train_10M" / "x.train").write_text("\n  \n")
    err = one_line_error(capsys, ["prepare", "--corpus", str(tmp_path / "empty"), "--workdir", str(tmp_path / "w")])
    assert "empty" in err and "x.train" in err
    err = one_line_error(capsys, ["prepare", "--corpus", str(tiny_corpus_dir), "--workdir", str(tmp_path / "w"),
                                  "--train-split", "train_1B"])
    assert "no split 'train_1B'" in err
    (tmp_path / "nothing").mkdir()
    assert "none of the BabyLM split folders" in one_line_error(
        capsys, ["prepare", "--corpus", str(tmp_path / "nothing"), "--workdir", str(tmp_path / "w")])
    assert not (tmp_path / "w" / "meta.json").exists()


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    path = tmp_path / "bad.train"
    path.write_bytes(b"caf\xe9 ok\n\xff\xfe end \xef\xbf\xbd\nplain\n")
    stats = ReadStats()
    docs = list(iter_documents([path], stats))
    assert docs == ["caf\ufffd ok", "\ufffd\ufffd end \ufffd", "plain"]
    assert stats.replaced_bytes == 3                       # the genuine U+FFFD is not counted
    assert stats.documents == 3 and stats.bytes == path.stat().st_size
    corpus = text_files_corpus({"train_10M": [path], "dev": [path]})
    with pytest.warns(SaffuWarning, match="invalid UTF-8"):               # 3 of 36 bytes: "is it a text file?"
        workdir = prepare(corpus, tmp_path / "w", PrepareConfig(vocab_size=270, allow_smaller_vocab=True),
                          show_progress=False)
    assert workdir.split_info("dev")["replaced_bytes"] == 3


@settings(max_examples=25, deadline=None)
@given(data=st.binary(max_size=300))
def test_reader_never_crashes_on_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "f.train"
    path.write_bytes(data)
    stats = ReadStats()
    docs = list(iter_documents([path], stats, max_line_bytes=64))
    assert all(len(d.encode("utf-8", "surrogatepass")) <= 64 * 3 for d in docs)
    assert stats.documents == len(docs)


def test_prepare_writes_frequency_ranked_streams(tiny_workdir, tiny_corpus_dir):
    meta = tiny_workdir.meta
    counts = tiny_workdir.token_counts()
    assert (np.diff(counts[2:]) <= 0).all()                       # ids follow frequency
    stream = np.asarray(tiny_workdir.tokens("train_10M"))
    info = tiny_workdir.split_info("train_10M")
    assert stream[0] == EOD_ID and stream[-1] == EOD_ID
    assert (stream == EOD_ID).sum() == info["documents"] + 1
    np.testing.assert_array_equal(np.bincount(stream[1:], minlength=len(counts)), counts)
    text = "".join(f.read_text() for f in sorted((tiny_corpus_dir / "train_10M").glob("*.train")))
    assert decode(tiny_workdir.tokenizer(), stream[1:].tolist()) == text   # lossless round trip
    assert info["bytes"] == len(text.encode())
    assert info["words"] == len(text.split()) + info["documents"]
    assert meta["dtype"] == "uint16" and json.loads((tiny_workdir.path / "meta.json").read_text())


def test_open_workdir_rejects_incomplete_directories(tmp_path, tiny_workdir):
    with pytest.raises(SaffuError, match=r"no meta\.json"):
        open_workdir(tmp_path)
    broken = tmp_path / "broken"
    (broken / "tokens").mkdir(parents=True)
    (broken / "meta.json").write_text((tiny_workdir.path / "meta.json").read_text())
    data = (tiny_workdir.path / "tokens" / "train_10M.bin").read_bytes()
    (broken / "tokens" / "train_10M.bin").write_bytes(data[:-2])
    (broken / "tokens" / "dev.bin").write_bytes((tiny_workdir.path / "tokens" / "dev.bin").read_bytes())
    with pytest.raises(SaffuError, match="truncated"):
        open_workdir(broken)


def test_download_from_a_local_release_zip(tmp_path):
    archive = tmp_path / "babylm_data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("babylm_data/babylm_10M/a.train", "one line\n")
        zf.writestr("babylm_data/babylm_dev/a.dev", "dev line\n")
        zf.writestr("babylm_data/babylm_test/a.test", "test line\n")
    dest = download_babylm(tmp_path / "corpus", url=archive.as_uri(), progress=False)
    corpus = babylm_corpus(dest)
    assert sorted(corpus.splits) == ["dev", "test", "train_10M"]
    assert corpus.files("dev")[0].read_text() == "dev line\n"
    with pytest.raises(SaffuError, match="sha256"):
        download_babylm(tmp_path / "again", url=archive.as_uri(), sha256="0" * 64, progress=False)
    assert not (tmp_path / "again").exists()
    with pytest.raises(SaffuError, match="cannot download"):
        download_babylm(tmp_path / "x", url=(tmp_path / "missing.zip").as_uri(), progress=False)


def test_vocabulary_larger_than_the_corpus_supports_is_one_line(tmp_path, capsys, tiny_corpus_dir):
    err = one_line_error(capsys, ["prepare", "--corpus", str(tiny_corpus_dir), "--workdir", str(tmp_path / "w"),
                                  "--vocab-size", "5000", "--quiet"])
    assert "supports only" in err and "a.train" in err and "--allow-smaller-vocab" in err
    assert not (tmp_path / "w" / "meta.json").exists()            # nothing a later command could use
    assert main(["prepare", "--corpus", str(tiny_corpus_dir), "--workdir", str(tmp_path / "w"),
                 "--vocab-size", "5000", "--allow-smaller-vocab", "--quiet"]) == 0
    assert open_workdir(tmp_path / "w").vocab_size < 5000
