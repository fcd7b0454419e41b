"""Chat data (SFT): templates render as transformers' apply_chat_template, only the assistant's tokens are
labels (checked against positions found in the text), bad templates and records are named before training."""
from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from titan_train import train
from titan_train.data import ByteTokenizer, HFTokenizer, PackedLoader
from titan_train.data.chat import BUILTIN_TEMPLATE, ChatEncoder

# A ChatML template in the style of Qwen2's (a default system turn, role checks, a generation prompt).
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{%- endif %}\n"
    "  {%- if not (message['role'] == 'system' and loop.first) %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
CONVERSATION = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."},
                {"role": "user", "content": "  And 4 * 4?  "}, {"role": "assistant", "content": "4 * 4 = 16."}]


@pytest.fixture
def chatml_folder(tmp_path):
    """A tokenizer folder as Hugging Face writes one: byte-level tokenizer.json with ChatML's special tokens."""
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path / "tokenizer"
    ByteTokenizer().save_hf(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=CHATML, eos_token="<|im_end|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_rendering_matches_transformers_apply_chat_template(chatml_folder):
    reference = transformers.AutoTokenizer.from_pretrained(chatml_folder)
    encoder = ChatEncoder.build("auto", HFTokenizer(chatml_folder), tokenizer_spec=str(chatml_folder))
    for messages in (CONVERSATION, [{"role": "system", "content": "Be brief."}, *CONVERSATION[:3]]):
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert encoder.render(messages, add_generation_prompt=prompt) == expected
    tokens, _ = encoder(CONVERSATION)
    ids = reference.apply_chat_template(CONVERSATION, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokens[:-1].tolist() == list(ids)  # the loader's EOS follows


def test_generation_blocks_render_as_transformers_renders_them(chatml_folder):
    turn = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    template = CHATML.replace(turn,
                              "{{- '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}"
                              "{% generation %}{{ message['content'] | trim + '<|im_end|>' }}{% endgeneration %}"
                              "{% else %}{{ message['content'] | trim + '<|im_end|>' }}{% endif %}{{ '\\n' }}")
    assert "{% generation %}" in template
    config = json.loads((chatml_folder / "tokenizer_config.json").read_text())
    (chatml_folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    reference = transformers.AutoTokenizer.from_pretrained(chatml_folder)
    encoder = ChatEncoder.build("auto", HFTokenizer(chatml_folder), tokenizer_spec=str(chatml_folder))
    assert encoder.render(CONVERSATION) == reference.apply_chat_template(CONVERSATION, tokenize=False)
    text, spans = encoder.assistant_spans(CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["2 + 3 = 5.<|im_end|>\n", "4 * 4 = 16.<|im_end|>\n"]


def test_only_assistant_tokens_are_labels(chatml_folder):
    encoder = ChatEncoder.build("auto", HFTokenizer(chatml_folder), tokenizer_spec=str(chatml_folder))
    text = encoder.render(CONVERSATION)
    tokens, scored = encoder(CONVERSATION)
    # Positions found in the text: each reply and its <|im_end|>\n, tokenized alone (byte-level, no merges).
    expected = np.zeros(len(tokens), dtype=bool)
    offset = 0
    for reply in ("2 + 3 = 5.<|im_end|>\n", "4 * 4 = 16.<|im_end|>\n"):
        start = text.index(reply, offset)
        before = len(HFTokenizer(chatml_folder).encode(text[:start]))
        expected[before:before + len(HFTokenizer(chatml_folder).encode(reply))] = True
        offset = start + len(reply)
    assert scored.sum() == expected.sum() > 20 and np.array_equal(scored, expected)

    # Through the packing loader: a label is kept exactly where the next token is scored.
    loader = PackedLoader([CONVERSATION] * 3, HFTokenizer(chatml_folder), seq_len=len(tokens) - 1, shuffle=False,
                          encode=encoder)
    batch = loader.next_batch(1)
    assert np.array_equal((batch.labels[0] != -100).numpy(), expected[1:])
    assert np.array_equal(batch.tokens[0].numpy(), tokens[:-1])


def test_builtin_template_masks_the_replies_of_packed_conversations():
    encoder = ChatEncoder(BUILTIN_TEMPLATE, ByteTokenizer(), origin="builtin")
    tokens, scored = encoder(CONVERSATION[:2])
    text = bytes(tokens[:-1].astype(np.uint8)).decode()
    assert text == "<|user|>\nWhat is 2 + 3?<|end|>\n<|assistant|>\n2 + 3 = 5.<|end|>\n"
    start = text.index("2 + 3 = 5.<|end|>")
    assert np.flatnonzero(scored).tolist() == list(range(start, len(text)))
    loader = PackedLoader([CONVERSATION[:2]] * 4, ByteTokenizer(), seq_len=100, shuffle=False, encode=encoder)
    batch = loader.next_batch(1)
    ids = batch.document_ids[0]
    assert ids.max() >= 1  # two conversations packed into the row, attention kept apart
    kept = (batch.labels[0] != -100).nonzero().flatten().tolist()
    doc_len = len(tokens)
    assert kept == [p - 1 for p in range(1, 101) if scored[p % doc_len]]


def test_bad_template_and_record_are_named_before_training(tmp_path, jobs):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n" +
                    json.dumps({"messages": [{"content": "no role here"}]}) + "\n")
    job = {"data.source": str(data), "data.chat": "true", "training.steps": "2", "checkpoint.interval": "1"}
    with pytest.raises(ValueError, match=r"chats.jsonl: record 2: message 1 has no role"):
        train(jobs.tiny(tmp_path / "no_role", **job))
    assert not (tmp_path / "no_role" / "checkpoints").exists()

    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] | no_such_filter }}{% endfor %}")
    with pytest.raises(ValueError, match=r"chat template .*bad.jinja does not compile: .*no_such_filter"):
        train(jobs.tiny(tmp_path / "bad_template", **job, **{"data.chat_template": str(template)}))
    template.write_text("{{ raise_exception('only one turn') }}")
    with pytest.raises(ValueError, match=r"chat template .*bad.jinja does not render: .*only one turn"):
        train(jobs.tiny(tmp_path / "bad_template", **job, **{"data.chat_template": str(template)}))
    assert not (tmp_path / "bad_template" / "checkpoints").exists()


def test_sft_recipe_fine_tunes_the_main_jobs_model(tmp_path, jobs):
    main_job = tmp_path / "main"
    train(jobs.tiny(main_job, **{"training.steps": "2", "checkpoint.interval": "2"}))
    job = {"training.steps": "6", "checkpoint.interval": "0"}
    sft = train(jobs.tiny(tmp_path / "sft", "llama3_debug_sft", **job, **{"checkpoint.initial_load": str(main_job)}))
    scratch = train(jobs.tiny(tmp_path / "scratch", "llama3_debug_sft", **job, **{"checkpoint.initial_load": ""}))
    assert sft.losses[1] != scratch.losses[1]  # it started from the main job's weights
    assert sft.losses[6] < sft.losses[1] - 0.5  # and learns the replies


def test_chat_records_from_parquet_and_a_saved_dataset(tmp_path):
    """The same conversations read from jsonl, parquet and a save_to_disk folder give the same batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_train.config import DataConfig

    conversations = [CONVERSATION, CONVERSATION[:2], [{"role": "system", "content": "Hi."}, *CONVERSATION[:2]]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    table = pa.table({"messages": conversations})
    pq.write_table(table, tmp_path / "c.parquet")
    saved = tmp_path / "saved"
    saved.mkdir()
    with pa.ipc.new_stream(str(saved / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    config = DataConfig(chat=True)
    batches = [config.packed_loader(str(source), ByteTokenizer(), seq_len=48, seed=0, shuffle=False).next_batch(3)
               for source in (tmp_path / "c.jsonl", tmp_path / "c.parquet", saved)]
    for batch in batches[1:]:
        assert torch_equal(batch.tokens, batches[0].tokens) and torch_equal(batch.labels, batches[0].labels)
    assert (batches[0].labels != -100).any() and (batches[0].labels == -100).any()


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_export_of_an_sft_run_carries_the_tokenizer_and_its_template(tmp_path, jobs, chatml_folder):
    from titan_train.export import export_job

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    train(jobs.tiny(tmp_path / "job", **{"data.source": str(data), "data.chat": "true", "data.tokenizer":
                                         str(chatml_folder), "training.steps": "1", "checkpoint.interval": "1"}))
    export_job(tmp_path / "job", tmp_path / "hf")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    original = transformers.AutoTokenizer.from_pretrained(chatml_folder)
    assert exported.apply_chat_template(CONVERSATION, tokenize=False) == original.apply_chat_template(
        CONVERSATION, tokenize=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size >= len(exported)
