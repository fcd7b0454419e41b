"""The demo (the root README's main command for now) runs and round-trips through HF files."""
from __future__ import annotations

from titan_models import demo


def test_demo_round_trips_the_debug_model(capsys):
    demo.main(["--seq-len", "16", "--batch", "1"])
    out = capsys.readouterr().out
    assert "logits [1, 16, 2048]" in out
    assert "logits identical: True" in out
