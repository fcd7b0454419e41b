"""Bad data stops the run before training, naming the file and the 1-based line (or row): broken jsonl
records, non-string text, a format flag the file contradicts, a malformed tokenizer.json, a corpus with
no tokens, and a resume with other data than the checkpoint's."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_train import train
from titan_train.cli import main
from titan_train.data import ByteTokenizer, PackedLoader, build_tokenizer, open_documents

GOOD = json.dumps({"text": "a good document"}) + "\n"


@pytest.mark.parametrize(("bad_line", "message"), [
    (b'{"text": "cut sh', r"line 3 is not valid JSON \(.*\); the file ends inside this record \(truncated\?\)"),
    (b'{"text": "caf\xe9"}\n', r"line 3 is not UTF-8 \(byte 14 of the line is b'\\xe9'\)"),
    (b'{"text": null}\n', r"line 3: field 'text' is null, not a string"),
    (b'{"text": 42}\n', r"line 3: field 'text' is a JSON int, not a string"),
    (b'{"text": ["a", "b"]}\n', r"line 3: field 'text' is a JSON list, not a string"),
    (b'["text", "a"]\n', r"line 3 is a JSON list, not an object with a 'text' field"),
    (b'"just a string"\n', r"line 3 is a JSON str, not an object"),
    (b'{"body": "x"}\n', r"line 3 has no field 'text' \(data.text_field; it has body\)"),
])
def test_bad_jsonl_lines_are_named_when_the_source_opens(tmp_path, bad_line, message):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + bad_line)  # line 2 is blank: lines are counted, not records
    with pytest.raises(ValueError, match=rf"{path}: {message}"):
        open_documents(str(path))


def test_bad_jsonl_stops_the_command_before_training(tmp_path, cli, capsys):
    path = tmp_path / "corpus.jsonl"
    path.write_text(GOOD * 50 + '{"text": null}\n')
    args = [*cli.TINY, "--job.folder", str(tmp_path / "run"), "--data.source", str(path), "--training.steps", "2"]
    assert main(args) == 2
    assert f"{path}: line 51: field 'text' is null" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_arrow_columns_that_are_not_strings(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "nulls.parquet")
    with pytest.raises(ValueError, match=r"nulls.parquet: row 2 of column 'text' is null"):
        open_documents(str(tmp_path / "nulls.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: column 'text' holds int64, not strings"):
        open_documents(str(tmp_path / "ints.parquet"))
    with pytest.raises(ValueError, match=r"ints.parquet: no column 'body' \(data.text_field; columns: text\)"):
        open_documents(str(tmp_path / "ints.parquet"), text_field="body")


def test_a_format_flag_the_file_contradicts(tmp_path):
    (tmp_path / "a.jsonl").write_text(GOOD)
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "b.parquet")
    (tmp_path / "c.data").write_text(GOOD)
    (tmp_path / "d.data").write_bytes((tmp_path / "b.parquet").read_bytes())
    cases = [
        ("a.jsonl", "parquet", "data.format=parquet but .*a.jsonl has the extension of a jsonl file"),
        ("b.parquet", "text", "data.format=text but .*b.parquet has the extension of a parquet file"),
        ("c.data", "parquet", r"data.format=parquet but .*c.data is not a parquet file \(no PAR1 header\)"),
        ("d.data", "jsonl", "data.format=jsonl but .*d.data is a parquet file"),
        ("a.jsonl", "hf_disk", "data.format=hf_disk needs a folder saved with save_to_disk, but .* is a file"),
        ("a.jsonl", "stdlib", "data.format=stdlib reads Python's own library"),
    ]
    for name, format, message in cases:
        with pytest.raises(ValueError, match=message):
            open_documents(str(tmp_path / name), format=format)
    with pytest.raises(ValueError, match="holds neither state.json nor dataset_dict.json"):
        open_documents(str(tmp_path), format="hf_disk")
    assert open_documents(str(tmp_path / "c.data"), format="jsonl")[0] == "a good document"  # unknown extension: read


def test_malformed_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    with pytest.raises(ValueError, match=r"data.tokenizer: .*tokenizer.json is not a valid tokenizer.json"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def test_a_corpus_without_tokens_stops_with_a_clear_message(tmp_path, jobs):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n" * 2 + json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="holds no tokens to train on: all 2 documents are empty"):
        PackedLoader(open_documents(str(path)), ByteTokenizer(), seq_len=8)
    with pytest.raises(ValueError, match="holds no tokens to train on"):
        train(jobs.tiny(tmp_path / "run", **{"data.source": str(path), "training.steps": "2"}))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # Some empty documents among others are fine (each contributes its end-of-document token).
    path.write_text(json.dumps({"text": ""}) + "\n" + GOOD)
    assert PackedLoader(open_documents(str(path)), ByteTokenizer(), seq_len=8).next_batch(2).tokens.shape == (2, 8)


def test_resume_with_another_data_source_is_refused(tmp_path, jobs, cli, capsys):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(30)))
    second.write_text("".join(json.dumps({"text": "x"}) + "\n" for _ in range(3)))
    job = {"checkpoint.interval": "2", "checkpoint.resume": "true", "training.steps": "2"}
    train(jobs.tiny(tmp_path / "run", **job, **{"data.source": str(first)}))
    with pytest.raises(ValueError, match="the checkpoint was written reading 30 documents with a 259-token vocabulary, "
                                         "but data.source and data.tokenizer now give 3 documents and 259 tokens"):
        train(jobs.tiny(tmp_path / "run", **{**job, "training.steps": "4", "data.source": str(second)}))
    # The same data resumes.
    same = jobs.tiny(tmp_path / "run", **{**job, "training.steps": "3", "data.source": str(first)})
    assert train(same).start_step == 2
