"""The offline docstring corpus."""

import json

import pytest

from mp_data.python_corpus import docstrings, write_docstring_corpus

LONG = "This function does something worth describing at some length, " * 2


def make_tree(root):
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text(
        f'"""{LONG}module"""\n\ndef f():\n    """{LONG}function"""\n\n'
        f'class C:\n    """short"""\n    def m(self):\n        """{LONG}method"""\n'
    )
    (root / "pkg" / "broken.py").write_text("def (:\n")  # skipped, not fatal
    (root / "b.py").write_bytes(b'"""\xff\xfe not utf-8"""')  # skipped too


def test_docstrings_in_path_order_without_short_ones(tmp_path):
    make_tree(tmp_path)
    texts = list(docstrings([str(tmp_path)]))
    assert [t.rsplit(" ", 1)[-1] for t in texts] == ["module", "function", "method"]


def test_written_corpus_is_jsonl_and_stops_at_the_size(tmp_path):
    make_tree(tmp_path / "src")
    out = tmp_path / "corpus.jsonl"
    written = write_docstring_corpus(str(out), 200, roots=[str(tmp_path / "src")])
    lines = out.read_text().splitlines()
    assert written == len(out.read_bytes()) and written >= 200
    assert len(lines) == 2 and json.loads(lines[0])["text"].endswith("module")


def test_too_little_text_is_an_error_and_leaves_no_file(tmp_path):
    make_tree(tmp_path / "src")
    out = tmp_path / "corpus.jsonl"
    with pytest.raises(ValueError, match=r"hold only .* bytes of docstrings; 100000 were asked"):
        write_docstring_corpus(str(out), 100_000, roots=[str(tmp_path / "src")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
