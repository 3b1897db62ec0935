"""A sweep's own files (its points, its recorded config) are written never through a planted link: the outside file
keeps its bytes and the write is one DataError naming the path."""

from dataclasses import dataclass, field

import pytest

from keel.errors import DataError
from keel.experiments import store
from keel.experiments.sweep import Sweep


def test_a_point_planted_as_a_link_is_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    points = tmp_path / "points"
    points.mkdir()
    (points / f"k{store.SUFFIX}").symlink_to(outside)
    with pytest.raises(DataError, match="symbolic link"):
        store.write(points, "k", {"select_loss": 1.0})
    assert outside.read_bytes() == b"keep me" and not [p for p in points.iterdir() if ".tmp-" in p.name]


@dataclass
class Seeds:
    seeds: list = field(default_factory=lambda: [0])


def test_the_recorded_config_planted_as_a_link_is_not_written_through(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (tmp_path / "points").mkdir()
    (tmp_path / "points" / "config.json").symlink_to(outside)
    with pytest.raises(DataError, match="symbolic link"):  # {} recorded: the sweep records its seeds
        Sweep(tmp_path, Seeds()).run({}, "nothing")
    assert outside.read_text() == "{}"


def test_a_point_is_written_whole_and_reads_back(tmp_path):
    point = {"select_loss": 1.25, "losses": [1.0, 0.5]}
    path = store.write(tmp_path, "k", point)
    assert store.read(path) == point and [p.name for p in tmp_path.iterdir()] == [path.name]
