"""`python -m titan_models.demo`: build the debug Llama 3, write it as a Hugging Face folder, load it
back, run a forward pass and print shapes, parameter count and training FLOPs per token."""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

import titan_models as tm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="llama3", help=f"model family, one of {[f.name for f in tm.families()]}")
    parser.add_argument("--flavor", default="debug", help="flavor name (see titan_models.flavors(family))")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence in the forward pass")
    parser.add_argument("--batch", type=int, default=2, help="sequences in the forward pass")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    config = tm.flavor(args.family, args.flavor)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as folder:
        tm.to_hf(model, folder)
        loaded = tm.from_hf(folder)
    with torch.no_grad():
        logits = loaded(tokens)
        same = torch.equal(logits, model(tokens))
    counts = tm.count_params(loaded)
    print(f"model        {args.family} {args.flavor}: {type(config).__name__}")
    print(f"tokens       {list(tokens.shape)} -> logits {list(logits.shape)} ({logits.dtype})")
    print(f"parameters   {counts.total:,} total, {counts.active:,} active per token, {counts.embedding:,} embedding")
    print(f"FLOPs/token  {tm.flops_per_token(loaded, args.seq_len):,} (training, seq_len {args.seq_len})")
    print(f"HF round trip: to_hf -> from_hf logits identical: {same}")
    print(f"done in {time.perf_counter() - start:.1f}s")
    if not same:
        raise SystemExit("the reloaded model's logits differ from the original's")


if __name__ == "__main__":
    main()
