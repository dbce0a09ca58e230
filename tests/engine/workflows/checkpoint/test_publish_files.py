"""The publisher's file work (engine/workflows/checkpoint/publish_files.py) on real files: it writes the
manifest then LATEST, and never through a symlink planted where the checkpoint's directory goes."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from engine.workflows.checkpoint.publish_files import Publication, PublishFailed


def test_a_publication_writes_the_manifest_then_latest(tmp_path: Path) -> None:
    Publication(tmp_path / "ck-1" / "checkpoint.json", b"{}", tmp_path / "LATEST", "ck-1").run()
    assert (tmp_path / "ck-1" / "checkpoint.json").read_bytes() == b"{}"
    assert (tmp_path / "LATEST").read_text() == "ck-1\n"


@pytest.mark.parametrize("link", ["directory", "parent-escape"])
def test_a_symlink_where_the_checkpoint_directory_goes_is_refused(tmp_path: Path, link: str) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "LATEST").write_text("ck-0\n")
    if link == "directory":
        (root / "ck-1").symlink_to(outside)
    else:  # a link to a directory inside the root, under another name
        (root / "other").mkdir()
        (root / "ck-1").symlink_to(root / "other")
    with pytest.raises(PublishFailed) as failed:
        Publication(root / "ck-1" / "checkpoint.json", b"{}", root / "LATEST", "ck-1").run()
    assert failed.value.error is not None and failed.value.error.errno == errno.ELOOP
    assert "symlink" in failed.value.describe()
    assert list(outside.iterdir()) == [] and not (root / "other" / "checkpoint.json").exists()
    assert (root / "LATEST").read_text() == "ck-0\n"
