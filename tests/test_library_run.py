"""A library run is a run (issue 19): ``ddiloco.SyncerServer`` + ``ddiloco.Learner`` in one
process write the run folder ``ddiloco syncer`` writes (run.json, config.toml, and model.json for
the model built in Python), the summary, status, report and export read it right, an evaluation
hook records the global model's loss, a time budget that cuts a run short says so, and failures
nobody watched for are unknown. Each test is a user's snippet, bounded in time; progress is
asserted, never durations."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import wait_for
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.errors import DDiLoCoError, UsageError
from ddiloco.service.base.transport import InProcessNetwork

SETTINGS = [
    "run.num_learners=2",
    "algo.sync_every=4",
    "algo.liveness_timeout_s=1.0",
    "runtime.heartbeat_interval_s=0.1",
    "runtime.syncer_liveness_s=1.0",
    "runtime.status_interval_s=0.2",
    "runtime.metrics_interval_s=0.2",
    "runtime.snapshot_interval_s=1.0",
    "runtime.backoff_max_s=0.3",
    "runtime.end_linger_s=0.3",
    "runtime.join_timeout_s=10.0",
]
TOKENS_PER_STEP = 8 * 6
BUDGET = 2 * 40 * TOKENS_PER_STEP  # two learners, 40 steps each
TIME_BUDGET_LINE = re.compile(
    r"the run ended at its time budget \(runtime\.duration_s = 1 s\) after [\d,]+ of its 10,000,000 tokens "
    r"\(\d+%; run\.processed_tokens\): raise runtime\.duration_s, or set it to inf for no time budget"
)


class Net(nn.Module):
    """A user's model: embeddings, a hidden layer, four classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids).mean(1))))


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 32, (8, 6), generator=g)
    return ids, ids[:, 0] % 4


HELD_OUT = [batch(torch.Generator().manual_seed(999)) for _ in range(4)]


def evaluate(model: nn.Module) -> dict[str, float]:
    """The user's evaluation: loss and accuracy on held-out batches."""
    loss = sum(float(F.cross_entropy(model(x), y)) for x, y in HELD_OUT) / len(HELD_OUT)
    accuracy = sum(float((model(x).argmax(1) == y).float().mean()) for x, y in HELD_OUT) / len(HELD_OUT)
    return {"loss": loss, "accuracy": accuracy}


def cfg(*extra: str):
    return load_config(None, [*SETTINGS, *extra])


def train(learner: ddiloco.Learner, model: nn.Module, seed: int, max_steps: int = 2000) -> None:
    """The user's loop, until the syncer ends the run; then the final sync."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        if learner.run_ended:
            break
        x, y = batch(g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        learner.step(tokens=x.numel())
        time.sleep(0.005)  # a stand-in for a real step's compute
    learner.finish()


def run_fleet(
    run_dir: Path,
    config: Any,
    learners: int = 2,
    serve: Callable[[ddiloco.SyncerServer], None] | None = None,
    model: nn.Module | None = None,
    **server_args: Any,
) -> ddiloco.SyncerServer:
    """A SyncerServer on an in-process network and ``learners`` learners as threads, until the
    run ends by itself (``serve`` may look at the server while it runs; ``model``: the syncer's,
    default a ``Net()``)."""
    torch.set_num_threads(1)
    net = InProcessNetwork()
    address = f"inproc://{run_dir.name}"
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(
        model or Net(), address, run_dir, config=config, transport=net.syncer(address), fsync=False, **server_args
    ).start()
    errors: list[BaseException] = []

    def learner(m: int) -> None:
        try:
            torch.manual_seed(100 + m)
            model = Net()
            train(ddiloco.Learner(model, address, learner_id=m, config=config, transport=net.learner), model, m)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=learner, args=(m,)) for m in range(learners)]
    for t in threads:
        t.start()
    if serve is not None:
        serve(server)
    for t in threads:
        t.join(timeout=60)
    assert server._thread is not None
    server._thread.join(timeout=60)  # the syncer ends the run itself: its thread finishes
    server.stop()
    assert not errors, errors
    return server


# -- 1. the run folder -------------------------------------------------------------------------


def test_a_library_run_writes_the_run_folder_and_reports_like_a_cli_run(tmp_path):
    from ddiloco.report.html import render_report
    from ddiloco.report.run_view import load_run
    from ddiloco.report.summary import summary_table
    from ddiloco.service.ops.status_cmd import run_status

    d = tmp_path / "lib"
    config = cfg(f"run.processed_tokens={BUDGET}", "runtime.duration_s=inf")  # no time budget: ends at tokens
    run_fleet(d, config)

    info = json.loads((d / "run.json").read_text())
    assert info["format"] == 2 and info["by"] == "ddiloco.SyncerServer (shard 0)"
    saved = load_config(d / "config.toml")  # the resolved config round-trips, with where the run is
    assert saved.run == config.run.__class__(**{**vars(config.run), "run_dir": str(d)})
    assert saved.algo == config.algo and saved.runtime == config.runtime
    model = json.loads((d / "model.json").read_text())
    assert model == {"module": __name__, "class": "Net", "parameters": sum(p.numel() for p in Net().parameters()),
                     "by": "ddiloco.SyncerServer (shard 0)", "hf_config": None}  # fmt: skip

    s = json.loads((d / "summary.json").read_text())
    assert s["method"] == "decoupled" and s["num_learners"] == 2 and s["by"] == "ddiloco.SyncerServer (shard 0)"
    assert 0.0 < s["goodput"] <= 1.0
    assert s["ended_by"] == "run.processed_tokens" and s["tokens_processed"] >= BUDGET
    assert s["failures"] is None and s["lost_steps"] is None  # nothing watched the learners for failures
    assert not any("time budget" in w for w in s["warnings"])
    # what crossed each learner's link, counted by the syncer (issue 20): steady and one-off, vs data-parallel
    traffic = s["traffic"]
    n_params = sum(p.numel() for p in Net().parameters())
    assert traffic["params"] == n_params and traffic["learners"] == 2
    assert traffic["dp_bytes_per_step"] == 2 * (2 - 1) / 2 * n_params * 4
    for m in ("0", "1"):
        row = traffic["by_learner"][m]
        assert row["steps"] > 0 and row["up_bytes_per_step"] > 0 and row["down_bytes_per_step"] > 0
        assert row["one_off_down_bytes"] > 0  # the join's fetch of every fragment, at least
    assert traffic["dp_ratio_up"] > 0 and traffic["dp_ratio_down"] > 0
    assert (d / "metrics" / "traffic.json").exists()
    table = io.StringIO()
    from rich.console import Console

    Console(file=table, width=120).print(summary_table(s, "library run"))
    assert re.search(r"│ failures\s+│\s+unknown │", table.getvalue())

    out = io.StringIO()
    with redirect_stdout(out):
        assert run_status([str(d)], as_json=True) == 0
    view = json.loads(out.getvalue())
    assert view["learners_total"] == 2 and {ln["learner"] for ln in view["learners"]} == {0, 1}
    assert view["traffic"]["up_bytes_per_step"] > 0 and all(ln["up_bytes_per_step"] > 0 for ln in view["learners"])

    run = load_run(d)
    assert run.num_learners == 2 and run.method == "decoupled"
    page = Path(render_report([d])).read_text()
    assert '<th>failures</th><td class="v">unknown</td>' in page
    assert f"<th>goodput</th><td class=\"v\">{s['goodput']:.1%}</td>" in page


def test_a_library_run_folder_keeps_its_config_like_a_cli_run(tmp_path):
    d = tmp_path / "lib"
    net = InProcessNetwork()
    ddiloco.SyncerServer(Net(), "inproc://a", d, config=cfg(), transport=net.syncer("inproc://a"), fsync=False).stop()
    refusal = (
        r"was made with algo\.sync_every = 4, but this command has algo\.sync_every = 8; only runtime\.\*, "
        r"run\.threads and a larger run\.num_learners may change on a run"
    )
    with pytest.raises(DDiLoCoError, match=refusal):
        ddiloco.SyncerServer(
            Net(), "inproc://b", d, config=cfg("algo.sync_every=8"), transport=net.syncer("inproc://b")
        )
    # a runtime change is fine, as on `ddiloco syncer`
    ddiloco.SyncerServer(Net(), "inproc://c", d, config=cfg("runtime.eval_interval_s=3"),
                         transport=net.syncer("inproc://c"), fsync=False).stop()  # fmt: skip


def test_export_reads_a_library_run(tmp_path):
    from ddiloco.export_cmd import run_export

    d = tmp_path / "lib"
    net = InProcessNetwork()
    torch.manual_seed(0)
    model = Net()
    with ddiloco.SyncerServer(model, "inproc://x", d, config=cfg(), transport=net.syncer("inproc://x"), fsync=False):
        pass  # started and stopped: the final model is the initial one
    out = run_export([str(d)], str(tmp_path / "m.safetensors"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in ddiloco.load_state_dict(out).items())
    with pytest.raises(DDiLoCoError) as e:
        run_export([str(d)], str(tmp_path / "hf"), fmt="hf")
    assert str(e.value) == (
        f"--format hf needs a Hugging Face model (one with save_pretrained); this run's model, {__name__}.Net, was "
        "built in Python (by ddiloco.SyncerServer (shard 0)) and has none: use --format safetensors"
    )


def test_export_format_hf_rebuilds_a_hugging_face_model_of_a_library_run(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ddiloco.export_cmd import run_export

    d = tmp_path / "lib"
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(hf_cfg)
    net = InProcessNetwork()
    with ddiloco.SyncerServer(model, "inproc://hf", d, config=cfg(), transport=net.syncer("inproc://hf"), fsync=False):
        pass
    info = json.loads((d / "model.json").read_text())
    assert info["class"] == "GPT2LMHeadModel" and info["hf_config"]["n_embd"] == 16
    out = run_export([str(d)], str(tmp_path / "hf"), fmt="hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_train_resume_refuses_a_library_run_in_one_line(tmp_path, capsys):
    from ddiloco.cli import main

    d = tmp_path / "lib"
    net = InProcessNetwork()
    ddiloco.SyncerServer(Net(), "inproc://r", d, config=cfg(), transport=net.syncer("inproc://r"), fsync=False).stop()
    assert main(["train", "--resume", str(d)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --resume {d}: this run's model was built in Python (ddiloco.SyncerServer, see model.json), which "
        "ddiloco train cannot rebuild: resume it with SyncerServer(model, BIND, RUN_DIR) and your learners"
    )


# -- 2. the evaluation hook --------------------------------------------------------------------


def test_the_evaluation_hook_records_the_global_model_and_the_final_one(tmp_path):
    d = tmp_path / "lib"
    server = run_fleet(d, cfg(f"run.processed_tokens={BUDGET}"), evaluate=evaluate, eval_interval_s=0.2)

    evals = [json.loads(line) for line in (d / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert len(evals) >= 2 and all(e["event"] == "eval" and set(e["metrics"]) == {"accuracy"} for e in evals)
    assert [e["final"] for e in evals] == [False] * (len(evals) - 1) + [True]  # the final one last, once
    assert all("versions" in e for e in evals[:-1])
    # at the cadence in merged tokens (automatic: 5 x H x B with fp32 both ways = 5 x 4 x 48), each
    # record saying where it ran, the fragments it fetched and the bytes it moved since the last one
    marks = [e["merged_tokens"] // (5 * 4 * TOKENS_PER_STEP) for e in evals[:-1]]
    assert marks[0] >= 1 and marks == sorted(set(marks))  # one per mark at most (a poll may pass two)
    for e in evals[:-1]:
        assert e["where"].startswith("evaluate hook in the syncer process on ")
        assert 1 <= e["fragments_fetched"] <= len(e["versions"]) and e["bytes_down"] > 0 and e["bytes_up"] > 0
    # the syncer's traffic meter counts the same bytes as observer traffic, on no learner's link
    assert server.evaluation is not None
    observed = server.service.traffic_dict()["by_learner"]["unattributed"]
    moved = server.evaluation.copy.moved
    assert (observed["up"]["observer"]["bytes"], observed["down"]["observer"]["bytes"]) == (moved.up, moved.down)
    assert sum(e["bytes_down"] for e in evals[:-1]) <= moved.down
    # the final record is the final global model, after the final sync: evaluate it ourselves
    final_model = Net()
    final_model.load_state_dict(ddiloco.load_state_dict(d))
    final_model.eval()
    with torch.no_grad():
        assert evals[-1]["loss"] == evaluate(final_model)["loss"]
    assert evals[-1]["merged_tokens"] >= evals[0]["merged_tokens"]
    s = json.loads((d / "summary.json").read_text())
    assert s["eval_loss"] == evals[-1]["loss"] and s["eval_metrics"] == evals[-1]["metrics"]
    assert not any("no evaluation" in w for w in s["warnings"])


def test_an_evaluation_hook_that_raises_never_stops_the_syncer(tmp_path, caplog):
    calls = []

    def broken(model: nn.Module) -> float:
        calls.append(1)
        raise RuntimeError("CUDA out of memory (a stand-in)")

    d = tmp_path / "lib"
    with caplog.at_level(logging.WARNING, logger="ddiloco.service.syncer.eval_hook"):
        run_fleet(d, cfg(f"run.processed_tokens={BUDGET}"), evaluate=broken, eval_interval_s=0.2)
    assert len(calls) >= 2  # called at intervals and at the end
    lines = [r.getMessage() for r in caplog.records if r.name == "ddiloco.service.syncer.eval_hook"]
    assert (
        "evaluate hook raised RuntimeError: CUDA out of memory (a stand-in); the final evaluation is not recorded"
        in lines
    )
    assert any(re.fullmatch(r"evaluate hook raised RuntimeError: .*; this evaluation \(the next at [\d,]+ merged "
                            r"tokens\) is not recorded", line) for line in lines)  # fmt: skip
    s = json.loads((d / "summary.json").read_text())
    assert s["ended_by"] == "run.processed_tokens" and s["tokens_merged"] > 0  # the run went on to its end
    assert s["eval_loss"] is None and "no evaluation of the global model was recorded" in s["warnings"]


def test_a_slow_evaluation_hook_is_off_the_merge_path(tmp_path):
    """The syncer merges while the hook evaluates: it never waits for it."""
    servers: list[ddiloco.SyncerServer] = []
    merged_during: list[int] = []

    def slow(model: nn.Module) -> float:
        before = servers[0].service.counts["merges"] if servers else 0
        time.sleep(0.6)
        merged_during.append((servers[0].service.counts["merges"] if servers else 0) - before)
        return evaluate(model)["loss"]

    d = tmp_path / "lib"
    run_fleet(d, cfg(f"run.processed_tokens={BUDGET}"), evaluate=slow, eval_interval_s=0.1, serve=servers.append)
    assert max(merged_during) > 0  # rounds closed while an evaluation slept
    evals = [json.loads(line) for line in (d / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["final"] is True


def test_an_evaluation_hook_that_returns_no_loss_is_said_in_one_line(tmp_path, caplog):
    d = tmp_path / "lib"
    with caplog.at_level(logging.WARNING, logger="ddiloco.service.syncer.eval_hook"):
        run_fleet(d, cfg(f"run.processed_tokens={BUDGET}"), learners=1, evaluate=lambda m: {"acc": 1.0})
    assert (
        "evaluate hook: its dict has no 'loss' (keys: acc); return the loss (a number) or a dict with a numeric "
        "'loss' and other metrics; the final evaluation is not recorded"
    ) in [r.getMessage() for r in caplog.records]
    assert not (d / "metrics" / "eval.jsonl").exists()


def test_the_evaluation_hook_over_zeromq_with_the_runs_keys(tmp_path):
    """The default set-up: CURVE keys made in RUN_DIR/keys, the hook fetching as an observer."""
    torch.set_num_threads(1)
    d = tmp_path / "lib"
    config = cfg(f"run.processed_tokens={BUDGET // 2}")
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(Net(), "tcp://127.0.0.1:*", d, config=config, fsync=False, evaluate=evaluate,
                                  eval_interval_s=0.2).start()  # fmt: skip
    model = Net()
    train(ddiloco.Learner(model, server.address, learner_id=0, config=config), model, seed=0)
    assert server._thread is not None
    server._thread.join(timeout=60)
    server.stop()
    evals = [json.loads(line) for line in (d / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["final"] is True and any(not e["final"] for e in evals)  # fetched through the observer path


def test_evaluation_hook_arguments_are_checked_in_one_line(tmp_path):
    net = InProcessNetwork()

    def server(n: int, **kw: Any) -> None:
        ddiloco.SyncerServer(Net(), f"inproc://s{n}", tmp_path / f"r{n}", config=cfg(),
                             transport=net.syncer(f"inproc://s{n}"), fsync=False, **kw)  # fmt: skip

    with pytest.raises(UsageError, match=r"^evaluate must be a function fn\(model\) -> loss or dict, not a str$"):
        server(1, evaluate="loss")
    with pytest.raises(UsageError, match=r"^eval_interval_s = 0 is out of range; allowed: a finite number > 0$"):
        server(2, evaluate=evaluate, eval_interval_s=0)
    with pytest.raises(UsageError, match=r"^eval_interval_s must be a number of seconds, not a str$"):
        server(3, evaluate=evaluate, eval_interval_s="5")
    with pytest.raises(UsageError, match=r"^eval_interval_s is given without evaluate=fn"):
        server(4, eval_interval_s=5)
    with pytest.raises(UsageError, match=r"^eval_every_tokens = -1 is out of range; allowed: a finite number >= 0 \("):
        server(6, evaluate=evaluate, eval_every_tokens=-1)
    with pytest.raises(UsageError, match=r"^eval_every_tokens must be a number of merged tokens, not a str$"):
        server(7, evaluate=evaluate, eval_every_tokens="5")
    with pytest.raises(UsageError, match=r"^eval_every_tokens is given without evaluate=fn"):
        server(8, eval_every_tokens=5)
    with pytest.raises(UsageError, match=r"^evaluate= needs the whole model, which a sharded syncer does not hold"):
        server(5, evaluate=evaluate, num_shards=2)


# -- 3. no silent time cap ---------------------------------------------------------------------


def test_a_run_has_no_time_budget_by_default():
    assert ddiloco.Config().runtime.duration_s == math.inf
    assert load_config(None).runtime.duration_s == math.inf


def test_no_time_budget_is_inf_in_config_and_config_toml(tmp_path):
    import tomli_w

    from ddiloco.config import to_dict

    config = load_config(None, ["runtime.duration_s=inf"])
    assert config.runtime.duration_s == math.inf
    (tmp_path / "c.toml").write_text(tomli_w.dumps(to_dict(config)))
    assert load_config(tmp_path / "c.toml").runtime.duration_s == math.inf
    with pytest.raises(DDiLoCoError, match=r"^runtime\.duration_s = nan is out of range; allowed: > 0$"):
        load_config(None, ["runtime.duration_s=nan"])


def test_a_time_budget_that_ends_a_run_short_of_its_tokens_says_so_in_the_log_and_the_summary(tmp_path, caplog):
    d = tmp_path / "lib"
    with caplog.at_level(logging.WARNING, logger="ddiloco.report.summary"):
        run_fleet(d, cfg("run.processed_tokens=10_000_000", "runtime.duration_s=1"), learners=1)
    s = json.loads((d / "summary.json").read_text())
    assert s["ended_by"] == "runtime.duration_s" and s["processed_tokens_budget"] == 10_000_000
    assert [w for w in s["warnings"] if TIME_BUDGET_LINE.fullmatch(w)]
    logged = [r for r in caplog.records if r.name == "ddiloco.report.summary"]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert TIME_BUDGET_LINE.fullmatch(logged[0].getMessage())


def test_chaos_in_train_needs_a_time_budget_and_says_so_before_any_folder(tmp_path, capsys, monkeypatch):
    from ddiloco.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--chaos", "--set", "runtime.duration_s=inf"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: chaos in ddiloco train places its faults over the run's length, runtime.duration_s, and this run has "
        "no time budget: set one (e.g. --set runtime.duration_s=300; the run still ends at its tokens if those come "
        "first)"
    )
    assert not (tmp_path / "runs").exists()


# -- 4. failures nobody watched for ------------------------------------------------------------


def test_failures_are_unknown_unless_a_launcher_watched(tmp_path):
    from ddiloco.report.summary import summarise

    d = tmp_path / "hand"
    (d / "metrics").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"format": 2, "started_at": 1000.0, "by": "ddiloco syncer (shard 0)"}))
    (d / "metrics" / "run.jsonl").write_text('{"event": "run", "time": 10.0, "what": "end", "reason": "x"}\n')
    s = summarise(d)
    assert s["failures"] is None and s["lost_steps"] is None  # a SIGKILL nobody saw is not 0 failures
    (d / "metrics" / "accounting.json").write_text(json.dumps({"horizon_s": 10.0, "learners": 2, "lost_steps": 0}))
    s = summarise(d)
    assert s["failures"] == 0 and s["lost_steps"] == 0.0  # a launcher watched and saw none


def test_an_evaluation_hooks_metrics_become_tensorboard_scalars():
    from ddiloco.report.tensorboard import scalar_records

    rec = {"event": "eval", "time": 2.0, "merged_tokens": 10, "loss": 0.5, "metrics": {"accuracy": 0.9, "loss": 7}}
    assert scalar_records("eval", rec) == [("eval/loss", 0.5, 2.0), ("eval/merged_tokens", 10.0, 2.0),
                                           ("eval/accuracy", 0.9, 2.0)]  # fmt: skip


def test_a_run_ended_on_a_count_nobody_vouched_for_goes_on_when_its_syncer_restarts(tmp_path, caplog):
    """The store of a finished run made to hold what an older syncer believed (learner 1 at
    2^53 tokens, the run ended on it early): a syncer restarted on the folder says in one line
    why the run stopped and goes on (the run log says "resume"), instead of leaving."""
    from ddiloco.report.tape import read_jsonl as lines
    from ddiloco.service.syncer.store import SyncerStore

    run_dir = tmp_path / "run"
    config = cfg(f"run.processed_tokens={BUDGET}")
    first = run_fleet(run_dir, config)
    store = SyncerStore(run_dir, 0, 1, fsync=False)
    found = store.restore(first.service.layout.fragments, first.service.core.owned)
    assert found is not None and found.syncer_meta is not None
    meta = {**found.syncer_meta, "fleet": {"best": [[0, 1, 40], [1, 1, 2**53]]}}
    store.snapshot(found.fragments.values(), meta)
    store.close()
    runlog = run_dir / "metrics" / "run.jsonl"
    reason = f"{2**53 + 40:,} tokens processed by the fleet, the budget is {BUDGET:,} (run.processed_tokens)"
    records = [r for r in lines(runlog) if r["what"] != "end"]
    records.append({"time": 5.0, "what": "end", "reason": reason, "processed_tokens": 2**53 + 40})
    runlog.write_text("".join(json.dumps(r) + "\n" for r in records))
    caplog.set_level(logging.WARNING)
    torch.manual_seed(0)
    again = ddiloco.SyncerServer(Net(), "inproc://again", run_dir, config=config, fsync=False,
                                 transport=InProcessNetwork().syncer("inproc://again")).start()  # fmt: skip
    try:
        wait_for(lambda: lines(runlog)[-1]["what"] == "resume", 60, "the restarted syncer to resume the run")
        said = [r.getMessage() for r in caplog.records if "the run goes on" in r.getMessage()]
        assert len(said) == 1 and reason in said[0] and "learner 1 claimed 9,007,199,254,740,992" in said[0], said
        assert not any("this run already ended" in r.getMessage() for r in caplog.records)
        assert again.service.session.end_stage is None and again.service.session.processed_tokens() == 40 + 4 * 40
    finally:
        again.stop()
