"""The built-in model's corpus: the running Python's standard library, as installed.

Owns: the exact recipe (which files, in which order, which are held out) and the documents made from
them, so the trainer and `dsaserve eval` read the same split. Every machine of the project has this text
without a download. Recipe:
  - files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, skipping `site-packages`,
    `dist-packages`, `__pycache__` and `config-*` directories, sorted by their relative POSIX path;
    a file that is not valid UTF-8 is skipped (a few test files are deliberately mis-encoded);
  - split: a file is held out when int(sha256(relative path)[:8], 16) % 1000 < heldout_permille
    (by name, so it does not depend on the file list or on the Python version's other files);
  - documents: each file's text as is, plus one chat document per public function / class docstring
    (`[gMASK]<sop><|user|><question><|assistant|></think><first paragraph of the docstring>`), in the GLM-5
    chat template's exact rendering with thinking off, so the model answers a chat request in English and
    then stops (EOS).
Documents are joined with the EOS token in the token stream (see `tokens_of`).
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
DEFAULT_HELDOUT_PERMILLE = 30
QUESTIONS = ("What does `{name}` in `{module}` do?", "Explain `{module}.{name}`.",
             "How do I use `{name}` from the `{module}` module?")
MAX_ANSWER_CHARS = 600


@dataclass
class CorpusRecipe:
    """What was read, written next to the model as corpus_recipe.json."""

    python_version: str
    stdlib: str
    heldout_permille: int
    max_files: int | None
    files: int = 0
    skipped_not_utf8: int = 0
    bytes: int = 0
    train_files: int = 0
    heldout_files: int = 0
    train_bytes: int = 0
    heldout_bytes: int = 0
    chat_docs_train: int = 0
    chat_docs_heldout: int = 0
    rule: str = ("*.py under stdlib minus site-packages/dist-packages/__pycache__/config-*, sorted by relative "
                 "path; held out iff int(sha256(relpath)[:8],16) % 1000 < heldout_permille; + one chat document "
                 "per public def/class docstring")
    heldout_sample: list[str] = field(default_factory=list)  # first held-out paths, to eyeball the split

    def to_dict(self) -> dict:
        return asdict(self)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")]
        for f in filenames:
            if f.endswith(".py"):
                out.append((Path(dirpath) / f).relative_to(root).as_posix())
    return sorted(out)


def is_heldout(relpath: str, permille: int = DEFAULT_HELDOUT_PERMILLE) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 1000 < permille


def _module_name(relpath: str) -> str:
    return relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def chat_documents(relpath: str, source: str) -> Iterator[str]:
    """One chat exchange per documented public top-level function/class (and public methods of classes)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # test files: deliberately invalid or deep
        return
    module = _module_name(relpath)
    nodes = [(n.name, n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    for cls in [n for _, n in nodes if isinstance(n, ast.ClassDef)]:
        nodes += [(f"{cls.name}.{m.name}", m) for m in cls.body if isinstance(m, ast.FunctionDef)]
    for name, node in nodes:
        if any(part.startswith("_") for part in name.split(".")):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 20:
            continue
        answer = doc.split("\n\n")[0].strip()[:MAX_ANSWER_CHARS]
        q = QUESTIONS[int(hashlib.sha256(f"{module}.{name}".encode()).hexdigest()[:4], 16) % len(QUESTIONS)]
        yield f"[gMASK]<sop><|user|>{q.format(name=name, module=module)}<|assistant|></think>{answer}"


@dataclass
class Split:
    train: list[str]
    heldout: list[str]
    recipe: CorpusRecipe


def load_split(heldout_permille: int = DEFAULT_HELDOUT_PERMILLE, max_files: int | None = None,
               root: Path | None = None, heldout_only: bool = False) -> Split:
    """Documents of the train and held-out split (max_files: the first N files only, for micro runs;
    heldout_only: skip reading the train files, as `dsaserve eval` needs only the held-out ones)."""
    root = root or stdlib_root()
    recipe = CorpusRecipe(sys.version.split()[0], str(root), heldout_permille, max_files)
    split = Split([], [], recipe)
    files = list_files(root)
    for rel in files[:max_files] if max_files else files:
        held = is_heldout(rel, heldout_permille)
        if heldout_only and not held:
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            recipe.skipped_not_utf8 += 1
            continue
        chats = list(chat_documents(rel, text))
        (split.heldout if held else split.train).extend([text, *chats])
        n = len(text.encode())
        recipe.files += 1
        recipe.bytes += n
        if held:
            recipe.heldout_files, recipe.heldout_bytes, recipe.chat_docs_heldout = (
                recipe.heldout_files + 1, recipe.heldout_bytes + n, recipe.chat_docs_heldout + len(chats))
            if len(recipe.heldout_sample) < 10:
                recipe.heldout_sample.append(rel)
        else:
            recipe.train_files, recipe.train_bytes, recipe.chat_docs_train = (
                recipe.train_files + 1, recipe.train_bytes + n, recipe.chat_docs_train + len(chats))
    return split


def tokens_of(tokenizer, docs: list[str], eos_id: int) -> list[int]:
    """One token stream: each document's ids followed by EOS (the model learns where a document ends)."""
    out: list[int] = []
    for enc in tokenizer.encode_batch(docs):
        out.extend(enc.ids)
        out.append(eos_id)
    return out


def windows(stream: list[int], length: int, n: int) -> list[list[int]]:
    """n evenly spaced, non-overlapping windows of `length` tokens (fewer if the stream is short)."""
    n = max(min(n, len(stream) // length), 0)
    step = len(stream) // max(n, 1)
    return [stream[i * step: i * step + length] for i in range(n)]
