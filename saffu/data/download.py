"""Download the official BabyLM release and lay it out the way :func:`babylm_corpus` reads.

The 2023 release is one zip (``babylm_data.zip``) holding ``babylm_data/babylm_10M/*.train``,
``babylm_100M/*.train``, ``babylm_dev/*.dev`` and ``babylm_test/*.test``; they become
``<dest>/train_10M``, ``train_100M``, ``dev`` and ``test``. Any URL ``urllib`` opens works,
``file://`` included (which is how the tests exercise it offline).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from saffu._io import SaffuError
from saffu.configs import BABYLM_2023_URL

#: Where the BabyLM organisers published the 2023 data (the site's repository).

_FOLDERS = {"babylm_10M": "train_10M", "babylm_100M": "train_100M", "babylm_dev": "dev",
            "babylm_test": "test"}


def download_babylm(dest: str | Path, url: str = BABYLM_2023_URL, sha256: str | None = None,
                    progress: bool = True) -> Path:
    """Fetch the release zip from ``url`` and unpack it into ``dest`` (BabyLM layout).

    Nothing appears in ``dest`` until the whole archive is downloaded, verified (when
    ``sha256`` is given) and unpacked. Returns ``dest``.
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise SaffuError(f"{dest} already exists and is not empty; choose a new folder")
    with tempfile.TemporaryDirectory(prefix="saffu-download-") as tmp:
        archive = Path(tmp) / "release.zip"
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url) as response, open(archive, "wb") as out:
                total = int(response.headers.get("Content-Length") or 0) or None
                with tqdm(total=total, unit="B", unit_scale=True, desc="download",
                          disable=not progress, leave=False) as bar:
                    while chunk := response.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise SaffuError(f"cannot download {url} ({getattr(err, 'reason', err)}); check the "
                             f"URL and network, or download it by hand and pass a file:// URL") from None
        if sha256 and digest.hexdigest() != sha256.lower():
            raise SaffuError(f"{url} has sha256 {digest.hexdigest()}, expected {sha256}; "
                             f"the download is corrupt or a different release")
        unpacked = Path(tmp) / "unpacked"
        try:
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(unpacked)
        except zipfile.BadZipFile:
            raise SaffuError(f"{url} is not a zip archive; pass the release's .zip") from None
        staged = Path(tmp) / "staged"
        staged.mkdir()
        for folder in unpacked.rglob("*"):
            if folder.is_dir() and folder.name in _FOLDERS:
                shutil.move(str(folder), staged / _FOLDERS[folder.name])
        if not any(staged.iterdir()):
            raise SaffuError(f"{url} holds none of {', '.join(_FOLDERS)}; is it the BabyLM release?")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            dest.rmdir()
        shutil.move(str(staged), dest)
    return dest
