"""JSONL readers split lines at "\\n" only: JSON leaves U+2028, U+2029, U+0085 and \\x1c-\\x1e unescaped inside
strings, and `str.splitlines` would cut a line that holds one in two."""

from __future__ import annotations

import json
from pathlib import Path

from dynrubric.jsonl import jsonl_lines, split_lines
from dynrubric.train.prompts import read_prompt_file

# what a query pasted from a web page or a PDF may carry: line and paragraph separators, NEL, a file separator
ODD = "first\u2028second\u2029third\x85fourth\x1cfifth"


def test_split_lines_ends_lines_at_newlines_only():
    text = json.dumps({"q": ODD}, ensure_ascii=False) + "\r\n" + "\n" + '{"q": 2}\n'
    assert len(text.splitlines()) > 3  # what the readers used to do
    assert split_lines(text) == [json.dumps({"q": ODD}, ensure_ascii=False), "", '{"q": 2}']
    assert split_lines("") == []
    assert split_lines("a") == ["a"]


def test_a_prompt_file_with_a_line_separator_inside_a_query_reads_whole(tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": f"Summarise: {ODD}"}, ensure_ascii=False) + "\n" + json.dumps({"prompt": "Hi"}) + "\n"
    )
    prompts = read_prompt_file(path)
    assert [p.messages[-1][1] for p in prompts] == [f"Summarise: {ODD}", "Hi"]


def test_a_sets_file_with_a_line_separator_inside_an_answer_reads_whole(tmp_path: Path):
    path = tmp_path / "sets.jsonl"
    line = {"prompt": "Q", "responses": [ODD, "b"], "passed": [True, False]}
    path.write_text(json.dumps(line, ensure_ascii=False) + "\n")
    assert list(jsonl_lines(path, "sets file", "pass another")) == [(1, line)]
