"""Data: tokenizers, every source format, packing with document ids, and exact loader resume."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from titan_train.data import IGNORE_INDEX, ByteTokenizer, HFTokenizer, PackedLoader, build_tokenizer, open_documents

DOCS = ["first document", "the second one, longer than the first", "3", "", "fifth: ünïcödé ✓"]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(DOCS[4])
    assert ids.dtype == np.int64 and ids.max() < 256 and tok.vocab_size == 259
    assert tok.decode(ids.tolist() + [tok.eos_id]) == DOCS[4]
    assert tok.encode(DOCS[4].encode()).tolist() == ids.tolist()


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS * 10, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(str(tmp_path))
    assert isinstance(hf, HFTokenizer) and hf.eos_id == tok.token_to_id("</s>")
    assert hf.encode("first document").tolist() == tok.encode("first document").ids
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    assert HFTokenizer(tmp_path / "tokenizer.json").eos_id == tok.token_to_id("<unk>")  # the config's choice wins
    with pytest.raises(ValueError, match="neither 'byte' nor a tokenizer.json"):
        build_tokenizer(str(tmp_path / "missing"))


def _write_hf_disk(folder, texts):
    """What datasets' save_to_disk writes: arrow stream files + state.json + dataset_info.json."""
    folder.mkdir(parents=True)
    table = pa.table({"text": texts, "id": list(range(len(texts)))})
    half = len(texts) // 2
    names = []
    for i, part in enumerate([table.slice(0, half), table.slice(half)]):
        names.append(f"data-0000{i}-of-00002.arrow")
        with pa.ipc.new_stream(str(folder / names[-1]), part.schema) as writer:
            writer.write_table(part)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "hf_disk", "hf_dataset_dict"])
def test_sources_read_every_document_in_order(tmp_path, kind):
    if kind == "text":
        folder = tmp_path / "texts"
        folder.mkdir()
        for i, doc in enumerate(DOCS):
            (folder / f"{i:02d}.txt").write_text(doc)
        source = folder
    elif kind == "jsonl":
        source = tmp_path / "docs.jsonl"
        source.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS)) + "\n")
    elif kind == "parquet":
        source = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"text": DOCS}), source, row_group_size=2)
    elif kind == "hf_disk":
        source = tmp_path / "saved"
        _write_hf_disk(source, DOCS)
    else:
        source = tmp_path / "dict"
        _write_hf_disk(source / "train", DOCS)
        _write_hf_disk(source / "test", ["held out"])
        (source / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    docs = open_documents(str(source))
    got = [d.decode() if isinstance(d, bytes) else d for d in (docs[i] for i in range(len(docs)))]
    assert got == DOCS
    if kind == "hf_dataset_dict":
        assert open_documents(str(source), split="test")[0] == "held out"
        with pytest.raises(ValueError, match="no split 'dev'"):
            open_documents(str(source), split="dev")


def test_source_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        open_documents(str(tmp_path / "nope"))
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="no field 'text'.*it has body"):
        open_documents(str(tmp_path / "a.jsonl"))[0]
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(ValueError, match="unknown extension '.csv'"):
        open_documents(str(tmp_path / "a.csv"))


def test_stdlib_corpus_is_python_source():
    docs = open_documents("stdlib")
    assert len(docs) > 100
    assert any(b"def " in docs[i] for i in range(10))


def _loader(docs, **kw):
    class Docs:
        def __len__(self):
            return len(docs)

        def __getitem__(self, i):
            return docs[i]
    return PackedLoader(Docs(), ByteTokenizer(), **{"seq_len": 8, "seed": 1, **kw})


def test_packing_covers_the_stream_with_document_ids_and_masked_boundaries():
    loader = _loader(["abcdef", "xy", "0123456789"], shuffle=False)
    batch = loader.next_batch(3)
    stream = [*b"abcdef", 257, *b"xy", 257, *b"0123456789", 257] * 2  # 21 tokens an epoch, same order
    # Rows are consecutive windows overlapping by one token: inputs tile the stream, labels shift by one.
    assert batch.tokens.flatten().tolist() == stream[:24]
    doc_of = [0] * 7 + [1] * 3 + [2] * 11 + [3] * 7
    for r in range(3):
        window = slice(8 * r, 8 * r + 8)
        ids = torch.tensor(doc_of[window])
        assert batch.document_ids[r].tolist() == (ids - ids[0]).tolist()  # numbered within the row
        for i in range(8):
            t = 8 * r + i
            expected = stream[t + 1] if doc_of[t + 1] == doc_of[t] else IGNORE_INDEX
            assert batch.labels[r, i].item() == expected
    plain = _loader(["abcdef", "xy", "0123456789"], shuffle=False, document_masking=False).next_batch(3)
    assert plain.document_ids is None and (plain.labels != IGNORE_INDEX).all()


def test_loader_resume_is_exact_across_epochs():
    docs = [f"document number {i} " * (i % 5 + 1) for i in range(13)]
    loader = _loader(docs)
    first = [loader.next_batch(3) for _ in range(4)]
    state = loader.state_dict()
    assert all(isinstance(v, int) for v in state.values())
    rest = [loader.next_batch(3) for _ in range(60)]  # several epochs of this small corpus
    assert loader.epoch >= 2
    resumed = _loader(docs)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for expected in rest:
        got = resumed.next_batch(3)
        assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.labels, expected.labels)
        assert torch.equal(got.document_ids, expected.document_ids)
    assert first[0].tokens.tolist() != _loader(docs, seed=2).next_batch(3).tokens.tolist()  # the seed shuffles
