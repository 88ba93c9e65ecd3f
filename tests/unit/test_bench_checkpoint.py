"""bench/gpu_pd.py's random checkpoint: made once, reused, and never left half-written."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import gpu_pd


def test_a_failed_write_leaves_nothing_and_a_complete_one_is_reused(tmp_path, monkeypatch):
    calls = []

    def failing(folder: Path, tokenizer_dir: Path, layers):
        calls.append(folder)
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        raise FileNotFoundError(tokenizer_dir)  # e.g. the tokenizer folder did not come along

    monkeypatch.setattr(gpu_pd, "make_checkpoint", failing)
    with pytest.raises(FileNotFoundError):
        gpu_pd.random_checkpoint(tmp_path / "missing-tokenizer", 1, root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # no folder to reuse, no partial one left

    def working(folder: Path, tokenizer_dir: Path, layers):
        calls.append(folder)
        folder.mkdir()
        (folder / "config.json").write_text('{"num_hidden_layers": %d}' % layers)
        (folder / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(gpu_pd, "make_checkpoint", working)
    made = Path(gpu_pd.random_checkpoint(tmp_path / "tok", 1, root=tmp_path))
    assert made == tmp_path / "tidepool-random-smollm2-1-layers"
    assert sorted(p.name for p in made.iterdir()) == ["config.json", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == [made.name]
    assert gpu_pd.random_checkpoint(tmp_path / "tok", 1, root=tmp_path) == str(made)
    assert len(calls) == 2  # the complete folder was reused, not written again
    assert all(c.parent == tmp_path and c != made for c in calls)  # written beside it, then renamed


def test_a_checkpoint_another_process_finished_first_serves(tmp_path, monkeypatch):
    final = tmp_path / "tidepool-random-smollm2"

    def racing(folder: Path, tokenizer_dir: Path, layers):
        folder.mkdir()
        (folder / "config.json").write_text("ours")
        final.mkdir()  # the other writer renames its complete folder in first
        (final / "config.json").write_text("theirs")

    monkeypatch.setattr(gpu_pd, "make_checkpoint", racing)
    assert gpu_pd.random_checkpoint(tmp_path / "tok", root=tmp_path) == str(final)
    assert (final / "config.json").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
