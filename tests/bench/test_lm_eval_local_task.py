"""bench/lm_eval_local_task.py writes a task lm-eval-harness reads: its jinja fields and a 4-choice dataset whose
label points at the true next line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import lm_eval_local_task  # noqa: E402


def test_the_task_file_and_its_documents(tmp_path, capsys):
    lm_eval_local_task.write(tmp_path, docs=12)
    task = yaml.safe_load((tmp_path / "stdlib_mc.yaml").read_text())
    assert task["doc_to_text"] == "{{context}}" and task["doc_to_choice"] == "{{choices}}"
    assert task["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "data.jsonl")
    docs = [json.loads(x) for x in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert len(docs) == 12 and all(len(d["choices"]) == 4 and 0 <= d["label"] < 4 for d in docs)
    assert len({d["choices"][d["label"]] for d in docs}) == 12  # each document's own next line
