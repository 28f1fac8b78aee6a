"""The built-in model's corpus recipe on a fake stdlib: which files, which are held out, the chat documents."""

from __future__ import annotations

import jinja2

from dsaserve.training import corpus
from dsaserve.weights.tokenizer_builder import CHAT_TEMPLATE

MODULE = '''"""A module."""


def public(x):
    """Return x doubled, for the test.

    More detail that is not part of the answer.
    """
    return 2 * x


def _private():
    """Private helpers are not asked about, whatever their docstring."""


class Box:
    """A box that holds one value for a while."""

    def open(self):
        """Open the box and give back its value."""
'''


def _fake_stdlib(root):
    files = {"a.py": MODULE, "pkg/__init__.py": "", "pkg/b.py": "x = 1\n", "site-packages/c.py": "skip = 1\n",
             "__pycache__/d.py": "skip = 2\n", "config-3.11/e.py": "skip = 3\n", "notes.txt": "not python\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "bad.py").write_bytes(b"s = '\xff\xfe'\n")  # not UTF-8
    return root


def test_file_list_sorted_and_filtered(tmp_path):
    root = _fake_stdlib(tmp_path)
    assert corpus.list_files(root) == ["a.py", "bad.py", "pkg/__init__.py", "pkg/b.py"]


def test_split_is_by_name_and_disjoint(tmp_path):
    root = _fake_stdlib(tmp_path)
    for permille in (0, 500, 1000):
        split = corpus.load_split(permille, root=root)
        r = split.recipe
        assert r.files == 3 and r.skipped_not_utf8 == 1
        assert r.train_files + r.heldout_files == 3
        held = {f for f in corpus.list_files(root) if corpus.is_heldout(f, permille) and f != "bad.py"}
        assert r.heldout_files == len(held)
    assert corpus.load_split(0, root=root).recipe.heldout_files == 0
    assert corpus.load_split(1000, root=root).recipe.train_files == 0
    only = corpus.load_split(1000, root=root, heldout_only=True)
    assert only.heldout == corpus.load_split(1000, root=root).heldout


def test_chat_documents_render_like_the_chat_template():
    docs = list(corpus.chat_documents("pkg/mod.py", MODULE))
    assert len(docs) == 3  # public, Box, Box.open; not _private
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    for doc in docs:
        prompt, answer = doc.split("<|assistant|></think>")
        question = prompt.split("<|user|>")[1]
        rendered = template.render(messages=[{"role": "user", "content": question}], add_generation_prompt=True,
                                   enable_thinking=False)
        assert doc == rendered + answer
        assert "More detail" not in answer and "pkg.mod" in question
    assert docs[0].endswith("Return x doubled, for the test.")


def test_windows_are_disjoint_and_in_order():
    stream = list(range(1000))
    wins = corpus.windows(stream, 100, 4)
    assert len(wins) == 4 and all(len(w) == 100 for w in wins)
    assert all(a[-1] < b[0] for a, b in zip(wins, wins[1:], strict=False))
    assert len(corpus.windows(stream, 400, 10)) == 2
