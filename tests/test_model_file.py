"""The final model file written piece by piece (``save_pieces``) reads back as the state dict."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from ddiloco.report.model_file import save_pieces


def test_pieces_written_one_at_a_time_read_back_as_whole_tensors_in_their_dtypes(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 3, generator=g)
    count = torch.tensor(7.4)
    entries = [
        ("w", torch.float32, (10, 3), [w[:4], w[4:9], w[9:]]),  # row-split across fragments
        ("head.w", torch.float32, (10, 3), [w]),  # a tied key: written again, a copy
        ("half", torch.bfloat16, (10, 3), [w[:5], w[5:]]),
        ("n", torch.int64, (), [count]),  # an integer buffer: rounded
    ]
    path = save_pieces(entries, tmp_path / "final" / "model.safetensors")
    got = load_file(str(path))
    assert torch.equal(got["w"], w) and torch.equal(got["head.w"], w)
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], w.to(torch.bfloat16))
    assert got["n"].dtype == torch.int64 and int(got["n"]) == 7
    assert not (tmp_path / "final" / "model.safetensors.tmp").exists()
