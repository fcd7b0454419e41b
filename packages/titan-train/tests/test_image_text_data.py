"""Image-text records from jsonl and from a saved dataset: image tokens in place, loss on the text only,
pixels as titan-models' preprocessing makes them, clear errors naming the record, and a run that trains."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from titan_train import load_recipe, train
from titan_train.cli_args import apply_override
from titan_train.data import ByteTokenizer
from titan_train.data.loader import IGNORE_INDEX
from titan_train.data.shapes import COLOURS, draw_shape

PIL = pytest.importorskip("PIL.Image", reason="Pillow decodes the images (titan-models[images])")


def _png(path, shape, colour, size=64, seed=0):
    pixels = draw_shape(shape, COLOURS[colour], torch.Generator().manual_seed(seed))
    image = PIL.fromarray(pixels.numpy())
    if size != 64:
        image = image.resize((size, size))
    image.save(path)
    return image


def _config(tmp_path, source, **overrides):
    config = load_recipe("qwen3_vl_debug_shapes")
    tiny = {"job.device": "cpu", "job.folder": str(tmp_path / "run"), "data.source": str(source),
            "data.image_field": "images", "data.shuffle": "false", "training.seq_len": "96",
            "data.image_min_pixels": "4096",
            "metrics.tensorboard": "false", "metrics.progress": "false", "checkpoint.resume": "false"}
    for name, value in {**tiny, **overrides}.items():
        apply_override(config, name, value)
    return config


def _loader(config):
    from titan_models import flavor

    model_config = flavor(config.model.family, config.model.flavor)
    return config.data.build(ByteTokenizer(), vocab_size=model_config.vocab_size, seq_len=config.training.seq_len,
                             seed=0, model_config=model_config), model_config


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_jsonl_records_put_image_tokens_in_place_and_score_only_text(tmp_path):
    from titan_models.models.qwen3_vl.preprocess import ImagePreprocessing

    _png(tmp_path / "a.png", "circle", "red")
    _png(tmp_path / "b.png", "square", "blue", size=96, seed=1)
    _write_jsonl(tmp_path / "data.jsonl", [
        {"text": "look <image> then <image> done", "images": ["a.png", "b.png"]},
        {"text": "a red circle", "images": ["a.png"]},  # no placeholder: the image comes first
        {"text": "just text", "images": []},
    ])
    loader, cfg = _loader(_config(tmp_path, tmp_path / "data.jsonl"))
    batch = loader.next_batch(3)
    tok, bytes_of = ByteTokenizer(), lambda s: ByteTokenizer().encode(s).tolist()
    pre = ImagePreprocessing.for_vision(cfg.vision, min_pixels=4096)
    want_pixels, want_grids = pre([PIL.open(tmp_path / "a.png"), PIL.open(tmp_path / "b.png")])
    counts = [int(g.prod()) // cfg.vision.spatial_merge_size**2 for g in want_grids]
    assert counts == [4, 9]  # 64 and 96 pixels, 16-pixel patches, 2x2 merge

    def image(n):
        return [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]

    rows = [bytes_of("look ") + image(4) + bytes_of(" then ") + image(9) + bytes_of(" done") + [tok.eos_id],
            image(4) + bytes_of("a red circle") + [tok.eos_id],
            bytes_of("just text") + [tok.eos_id]]
    for r, row in enumerate(rows):
        full = torch.cat([batch.tokens[r], batch.labels[r][-1:].clamp(min=0)])
        assert full[:len(row)].tolist() == row
        labels = batch.labels[r]
        is_text = torch.tensor([t not in (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id)
                                for t in row[1:]])
        assert torch.equal(labels[:len(row) - 1] != IGNORE_INDEX, is_text)
        assert (labels[len(row) - 1:] == IGNORE_INDEX).all()  # padding
    assert torch.equal(batch.images[0][0], want_pixels) and torch.equal(batch.images[0][1], want_grids)
    assert torch.equal(batch.images[1][0], pre([PIL.open(tmp_path / "a.png")])[0])
    assert batch.images[2][0].shape[0] == 0
    inputs = batch.image_inputs()
    assert inputs["image_grid_thw"].shape == (3, 3)  # the images of rows 0 and 1, in order
    # the loader's position is its state
    again, _ = _loader(_config(tmp_path, tmp_path / "data.jsonl"))
    again.load_state_dict(loader.state_dict())
    assert torch.equal(again.next_batch(2).tokens, loader.next_batch(2).tokens)


@pytest.mark.parametrize("family,flavor,reference,markers", [
    ("kimi_k25", "debug", "Kimi_K25ImageProcessor", ("vision_start_token_id", "vision_end_token_id")),
    ("muse_glimmer", "debug_vision", "MuseGlimmerImageProcessor", ("image_start_token_id", "image_end_token_id")),
])
def test_each_vision_family_gets_its_processors_pixels_and_its_image_tokens(tmp_path, family, flavor, reference,
                                                                           markers):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torchvision", reason="transformers' Kimi and Muse image processors need torchvision")
    images = [_png(tmp_path / "a.png", "circle", "red"), _png(tmp_path / "b.png", "square", "blue", size=96, seed=1)]
    _write_jsonl(tmp_path / "data.jsonl", [{"text": "look <image> then <image> done", "images": ["a.png", "b.png"]}])
    loader, cfg = _loader(_config(tmp_path, tmp_path / "data.jsonl", **{
        "model.family": family, "model.flavor": flavor, "data.image_min_pixels": "65536"}))
    batch = loader.next_batch(1)
    want = getattr(transformers, reference)()(images, return_tensors="pt")  # the processor, independently
    assert torch.equal(batch.images[0][0], want["pixel_values"])
    assert torch.equal(batch.images[0][1], want["image_grid_thw"])
    start, end = (getattr(cfg, name) for name in markers)
    bytes_of = lambda s: ByteTokenizer().encode(s).tolist()  # noqa: E731
    counts = [int(g.prod()) // cfg.vision.merge_size**2 for g in want["image_grid_thw"]]
    row = (bytes_of("look ") + [start] + [cfg.image_token_id] * counts[0] + [end] + bytes_of(" then ")
           + [start] + [cfg.image_token_id] * counts[1] + [end] + bytes_of(" done"))
    assert batch.tokens[0, :len(row)].tolist() == row
    assert counts[0] == 9  # 64 pixels: Kimi pads to 84 (6 x 6 patches), Muse resizes to 3 x 3 merged patches
    # Qwen3-VL's pixel bounds mean nothing here: refused rather than ignored
    with pytest.raises(ValueError, match="bound Qwen3-VL's resizing"):
        _loader(_config(tmp_path, tmp_path / "data.jsonl", **{"model.family": family, "model.flavor": flavor}))


def test_a_saved_dataset_with_an_image_column_reads_the_same(tmp_path):
    _png(tmp_path / "a.png", "triangle", "green")
    _write_jsonl(tmp_path / "data.jsonl", [{"text": "<image> a green triangle", "images": ["a.png"]}])
    folder = tmp_path / "saved"
    folder.mkdir()
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"text": ["<image> a green triangle"],
                      "images": pa.array([[{"bytes": (tmp_path / "a.png").read_bytes(), "path": None}]],
                                         type=pa.list_(struct))})
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    from_jsonl = _loader(_config(tmp_path, tmp_path / "data.jsonl"))[0].next_batch(1)
    from_disk = _loader(_config(tmp_path, folder))[0].next_batch(1)
    assert torch.equal(from_jsonl.tokens, from_disk.tokens) and torch.equal(from_jsonl.labels, from_disk.labels)
    assert torch.equal(from_jsonl.images[0][0], from_disk.images[0][0])


@pytest.mark.parametrize("record,message", [
    ({"text": "<image> x", "images": ["missing.png"]}, r"record 1: image file .*missing.png does not exist"),
    ({"text": "<image> x", "images": ["bad.png"]}, r"record 1: image .*bad.png is unreadable"),
    ({"text": "<image> <image> x", "images": ["a.png"]}, r"record 1 has 2 '<image>' placeholder\(s\) but 1 image"),
    ({"text": "<image> " + "x" * 200, "images": ["a.png"]}, r"record 1 takes .* more than training.seq_len=96"),
], ids=["missing", "unreadable", "placeholders", "too-long"])
def test_bad_records_are_refused_naming_the_record(tmp_path, record, message):
    _png(tmp_path / "a.png", "circle", "red")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    _write_jsonl(tmp_path / "data.jsonl", [record])
    loader, _ = _loader(_config(tmp_path, tmp_path / "data.jsonl"))
    with pytest.raises(ValueError, match=message):
        loader.next_batch(1)


def test_image_field_needs_a_vision_model_and_one_source(tmp_path):
    _write_jsonl(tmp_path / "data.jsonl", [{"text": "x", "images": []}])
    config = _config(tmp_path, tmp_path / "data.jsonl", **{"model.family": "llama3", "model.flavor": "debug"})
    with pytest.raises(ValueError, match="needs a vision-language model"):
        _loader(config)
    # a vision family's flavor without a tower
    config = _config(tmp_path, tmp_path / "data.jsonl", **{"model.family": "muse_glimmer", "model.flavor": "debug"})
    with pytest.raises(ValueError, match="needs a vision-language model.*has no vision tower"):
        _loader(config)
    with pytest.raises(ValueError, match="reads one jsonl/hf_disk data.source"):
        _loader(_config(tmp_path, "stdlib"))


def test_the_debug_vlm_trains_on_jsonl_image_text(tmp_path):
    records = []
    for i, (shape, colour) in enumerate([(s, c) for s in ("circle", "square", "triangle") for c in COLOURS]):
        _png(tmp_path / f"{i}.png", shape, colour, seed=i)
        records.append({"text": f"<image>a {colour} {shape}", "images": [f"{i}.png"]})
    _write_jsonl(tmp_path / "data.jsonl", records)
    losses = train(_config(tmp_path, tmp_path / "data.jsonl", **{
        "training.steps": "12", "training.seq_len": "32", "data.shuffle": "true"})).losses
    assert all(loss == loss for loss in losses.values())
    assert sum(losses[s] for s in (10, 11, 12)) < 0.5 * sum(losses[s] for s in (1, 2, 3)), losses
