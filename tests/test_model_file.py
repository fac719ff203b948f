"""The final model file: written piece by piece (``save_pieces``, the syncer's) or from a state
dict (``save_state_dict``), it reads back as the state dict. A tied tensor (an LM head sharing
the embedding) is stored once and its other names come back from the file's alias map, which
is untrusted input: a malformed or hostile map is one DDiLoCoError line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.errors import DDiLoCoError
from ddiloco.report.model_file import ALIASES, MAX_ALIASES_CHARS, load_state_dict, save_pieces, save_state_dict
from ddiloco.service.base.transport import InProcessNetwork


def test_pieces_written_one_at_a_time_read_back_as_whole_tensors_in_their_dtypes(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 3, generator=g)
    count = torch.tensor(7.4)
    entries = [
        ("w", torch.float32, (10, 3), [w[:4], w[4:9], w[9:]]),  # row-split across fragments
        ("head.w", torch.float32, (10, 3), [w]),  # the same values, no alias given: written again
        ("half", torch.bfloat16, (10, 3), [w[:5], w[5:]]),
        ("n", torch.int64, (), [count]),  # an integer buffer: rounded
    ]
    path = save_pieces(entries, tmp_path / "final" / "model.safetensors")
    got = load_file(str(path))
    assert torch.equal(got["w"], w) and torch.equal(got["head.w"], w)
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], w.to(torch.bfloat16))
    assert got["n"].dtype == torch.int64 and int(got["n"]) == 7
    assert not (tmp_path / "final" / "model.safetensors.tmp").exists()


# -- tied weights ---------------------------------------------------------------------------


class Tied(nn.Module):
    """A small LM: its head is the embedding (one Parameter under two state-dict names)."""

    def __init__(self, vocab: int = 256, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.wte(ids))))


def header(path: Path) -> dict[str, object]:
    """A safetensors file's JSON header, as written."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    out: dict[str, object] = json.loads(raw[8 : 8 + n])
    return out


def data_bytes(path: Path) -> int:
    """A safetensors file's tensor bytes: all of it but its header."""
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return path.stat().st_size - 8 - n


def model_bytes(model: nn.Module) -> int:
    """The model's values, each tensor once (a tied one counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def assert_stored_once_and_loads_strictly(path: Path, model: nn.Module) -> None:
    head = header(path)
    assert "wte.weight" in head and "head.weight" not in head  # the tensor once
    assert json.loads(head["__metadata__"][ALIASES]) == {"head.weight": "wte.weight"}  # type: ignore[index]
    assert data_bytes(path) == model_bytes(model)  # 1.0x the model (it was 1.9x here, the head written twice)
    state = load_state_dict(path)
    assert set(state) == set(model.state_dict())
    assert state["head.weight"] is state["wte.weight"]  # one tensor, as the model has it
    fresh = Tied()
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.wte.weight  # the module's tie is its own: intact
    assert fresh.head.weight.data_ptr() == fresh.wte.weight.data_ptr()
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_save_state_dict_writes_a_tied_tensor_once_and_it_loads_back_strictly_with_its_tie(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    path = save_state_dict(model.state_dict(), tmp_path / "m.safetensors")
    assert_stored_once_and_loads_strictly(path, model)
    assert header(path)["__metadata__"]["format"] == "pt"  # type: ignore[index]  # Hugging Face's loaders ask for it
    out = ddiloco.export_model(Tied(), path, tmp_path / "out")
    assert_stored_once_and_loads_strictly(out / "model.safetensors", model)
    # written again from what it read (ddiloco export's safetensors format): still once
    again = save_state_dict(load_state_dict(path), tmp_path / "again.safetensors")
    assert_stored_once_and_loads_strictly(again, model)


def test_overlapping_but_different_views_are_copies_not_aliases(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    path = save_state_dict({"w": w, "t": w.t(), "row": w[1], "same": w}, tmp_path / "m.safetensors")
    assert set(header(path)) - {"__metadata__"} == {"w", "t", "row"}
    state = load_state_dict(path)
    assert torch.equal(state["t"], w.t()) and torch.equal(state["row"], w[1]) and state["same"] is state["w"]


def test_save_pieces_writes_a_tied_key_once_as_an_alias(tmp_path):
    w = torch.randn(6, 2)
    entries = [("wte.weight", torch.float32, (6, 2), [w[:3], w[3:]])]
    path = save_pieces(entries, tmp_path / "m.safetensors", {"head.weight": "wte.weight"})
    state = load_state_dict(path)
    assert list(header(path))[0] == "__metadata__" and torch.equal(state["head.weight"], w)
    with pytest.raises(DDiLoCoError, match="must be a stored tensor"):
        save_pieces(entries, tmp_path / "bad.safetensors", {"head.weight": "nowhere"})
    with pytest.raises(DDiLoCoError, match="must be a stored tensor"):
        save_pieces(entries, tmp_path / "bad.safetensors", {"wte.weight": "wte.weight"})


def test_the_syncers_final_model_holds_a_tied_tensor_once_and_exports(tmp_path):
    """The syncer's own writer (``save_pieces`` from the core's fragments, the embedding
    row-split across fragments), through a SyncerServer that stops at once."""
    address = "inproc://model-file-tied"
    cfg = load_config(None, ["algo.num_fragments=3", "algo.sync_every=6"])
    torch.manual_seed(0)
    model = Tied()
    server = ddiloco.SyncerServer(
        model, address, tmp_path / "run", config=cfg, transport=InProcessNetwork().syncer(address), fsync=False
    ).start()
    path = server.stop()
    assert path == tmp_path / "run" / "final" / "model.safetensors"
    assert_stored_once_and_loads_strictly(path, model)
    assert set(load_state_dict(tmp_path / "run")) == set(model.state_dict())  # the run folder names the file
    out = ddiloco.export_model(Tied(), tmp_path / "run", tmp_path / "out")
    assert_stored_once_and_loads_strictly(out / "model.safetensors", model)


def test_a_file_with_tied_weights_as_copies_and_no_alias_map_loads_as_before(tmp_path):
    """What ddiloco wrote before aliases: the head a copy of the embedding, no metadata."""
    torch.manual_seed(0)
    model = Tied()
    sd = model.state_dict()
    old = {k: v.clone() for k, v in sd.items()}
    path = tmp_path / "old.safetensors"
    save_file(old, str(path))
    state = load_state_dict(path)
    plain = load_file(str(path))
    assert list(state) == list(plain) and all(torch.equal(state[k], plain[k]) for k in plain)
    assert state["head.weight"] is not state["wte.weight"]  # two tensors, as written
    fresh = Tied()
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.wte.weight and torch.equal(fresh.wte.weight, sd["wte.weight"])
    # another tool's metadata with no alias map is ignored
    save_file(old, str(path), metadata={"format": "pt", "note": "head.weight"})
    assert set(load_state_dict(path)) == set(sd)


def hostile(tmp_path: Path, aliases: str) -> Path:
    w = torch.randn(4, 2)
    path = tmp_path / "hostile.safetensors"
    save_file({"wte.weight": w, "body.weight": w.clone()}, str(path), metadata={"format": "pt", ALIASES: aliases})
    return path


@pytest.mark.parametrize(
    ("aliases", "why"),
    [
        ("{", "is not a JSON object"),
        ("[" * 100_000 + "]" * 100_000, "is not a JSON object"),  # nesting that would exhaust the stack
        ('["head.weight", "wte.weight"]', "is a JSON list, not an object"),
        ('"wte.weight"', "is a JSON str, not an object"),
        ('{"head.weight": 3}', "to a int, not a tensor name"),
        ('{"head.weight": {"x": "wte.weight"}}', "to a dict, not a tensor name"),
        ('{"head.weight": "nowhere"}', "which the file does not hold"),  # an unknown target
        ('{"a": "b", "b": "a"}', "which the file does not hold"),  # a cycle
        ('{"a": "a"}', "which the file does not hold"),  # itself
        ('{"a": "head.weight", "head.weight": "wte.weight"}', "which the file does not hold"),  # a chain
        ('{"body.weight": "wte.weight"}', "but it is a tensor"),  # would silently replace a stored tensor
        ('{"": "wte.weight"}', "but it is empty"),
        ('{"head.weight": "wte.weight", "head.weight": "body.weight"}', "a name is listed twice"),
        ('{"h": "' + "x" * MAX_ALIASES_CHARS + '"}', f"is over {MAX_ALIASES_CHARS} characters"),
    ],
)
def test_a_malformed_or_hostile_alias_map_is_one_clear_error(tmp_path, aliases, why):
    path = hostile(tmp_path, aliases)
    with pytest.raises(DDiLoCoError) as e:
        load_state_dict(path)
    msg = str(e.value)
    assert why in msg and "tied-weights map" in msg and str(path) in msg and "\n" not in msg and len(msg) < 600


def test_an_alias_map_that_is_not_text_or_a_file_that_is_not_safetensors_is_one_clear_error(tmp_path):
    w = torch.randn(4, 2).numpy().tobytes()
    head = {"__metadata__": {ALIASES: {"head.weight": "wte.weight"}}, "wte.weight": {}}
    head["wte.weight"] = {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, len(w)]}
    raw = json.dumps(head).encode()
    path = tmp_path / "object.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + w)  # metadata values must be strings
    with pytest.raises(DDiLoCoError, match="is not a readable safetensors file") as e:
        load_state_dict(path)
    assert "\n" not in str(e.value)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(DDiLoCoError, match="is not a readable safetensors file"):
        load_state_dict(junk)


def test_a_live_syncers_tied_state_is_one_copy_and_saves_once(tmp_path):
    """``fetch_state`` (``ddiloco export tcp://...``): the tied keys share one copy, so the file
    written from it holds the tensor once."""
    cfg = load_config(None, ["algo.num_fragments=3", "algo.sync_every=6"])
    torch.manual_seed(0)
    model = Tied()
    server = ddiloco.SyncerServer(model, "tcp://127.0.0.1:*", tmp_path / "run", config=cfg, insecure=True).start()
    try:
        state = ddiloco.fetch_state(Tied(), [server.address], config=cfg, insecure=True)
    finally:
        server.stop()
    assert state["head.weight"] is state["wte.weight"] and torch.equal(state["wte.weight"], model.wte.weight)
    assert_stored_once_and_loads_strictly(save_state_dict(state, tmp_path / "live.safetensors"), model)


def test_a_hugging_face_gpt2s_tied_head_is_written_once_by_the_syncer_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    address = "inproc://model-file-gpt2"
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=512, n_positions=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    cfg = load_config(None, ["algo.num_fragments=3", "algo.sync_every=6"])
    server = ddiloco.SyncerServer(
        model, address, tmp_path / "run", config=cfg, transport=InProcessNetwork().syncer(address), fsync=False
    ).start()
    path = server.stop()
    head = header(path)
    assert "transformer.wte.weight" in head and "lm_head.weight" not in head
    assert data_bytes(path) == model_bytes(model)  # 1.0x the model (1.7x before, the head written twice)
    state = load_state_dict(path)
    fresh = transformers.GPT2LMHeadModel(config)
    fresh.load_state_dict(state, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    out = ddiloco.export_model(transformers.GPT2LMHeadModel(config), tmp_path / "run", tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_saved_model_file_is_readable_as_the_umask_allows(tmp_path):
    """safetensors makes its files 0600; an exported model is a file like any other (issue 35)."""
    import os

    old = os.umask(0o022)
    try:
        path = ddiloco.save_state_dict({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        assert path.stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        assert ddiloco.save_state_dict({"w": torch.ones(2)}, path).stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
