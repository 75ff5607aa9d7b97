"""--data-args-path and --per-split-data-args-path: data paths read from a file."""

import json

import pytest

from mp_data import DataConfig


def test_data_args_path_gives_the_blend(tmp_path):
    blend = tmp_path / "blend.txt"
    blend.write_text("0.3 /data/a_text_document\n0.7\t/data/b_text_document\n")
    config = DataConfig(data_args_path=str(blend))
    assert config.data_path == ["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"]


def test_per_split_data_args_path_gives_each_split(tmp_path):
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": ["1", "/d/train"], "valid": "/d/valid",
                                  "test": []}))  # fmt: skip
    config = DataConfig(per_split_data_args_path=str(splits))
    assert config.train_data_path == ["1", "/d/train"]
    assert config.valid_data_path == ["/d/valid"]
    assert config.test_data_path is None


def test_bad_files_name_the_file_and_the_fault(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data_args_path .*missing.txt: cannot read it"):
        DataConfig(data_args_path=str(tmp_path / "missing.txt"))
    blend = tmp_path / "blend.txt"
    blend.write_text("/d/a")
    with pytest.raises(ValueError, match="data_path and data_args_path are exclusive"):
        DataConfig(data_args_path=str(blend), data_path=["/d/b"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"train": ["/d/a"],\n "valid": [}')
    with pytest.raises(ValueError, match=r"bad.json, line 2: not JSON"):
        DataConfig(per_split_data_args_path=str(bad))
    partial = tmp_path / "partial.json"
    partial.write_text('{"train": ["/d/a"], "valid": []}')
    with pytest.raises(ValueError, match="no 'test' key"):
        DataConfig(per_split_data_args_path=str(partial))
