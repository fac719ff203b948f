"""A Hugging Face causal LM trained by Decoupled DiLoCo: two learners and a syncer.

The model is built from a small config (``AutoModelForCausalLM.from_config``: nothing is
downloaded) and reads byte-level tokens of any text file through ddiloco's text workload. Each
learner is an ordinary training loop with its own AdamW and LR scheduler; three lines make it
a learner. At the end the global model is evaluated and exported with ``save_pretrained``.

    python examples/hf_causal_lm.py --text corpus.txt              # syncer + 2 learners, locally

The syncer makes the run's CURVE keys in RUN_DIR/keys (unless given --keys DIR); a learner
uses --keys DIR, or else RUN_DIR/keys. Across machines, run the roles yourself and copy the keys
a learner needs (syncer.key, learner-ID.key_secret) to its machine (see docs/security.md):

    python examples/hf_causal_lm.py --text corpus.txt --role syncer --bind tcp://0.0.0.0:5555
    python examples/hf_causal_lm.py --text corpus.txt --role learner --id 0 --syncer tcp://HOST:5555 --keys KEYS
"""

from __future__ import annotations

import argparse
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config

import ddiloco
from ddiloco.workloads.config import WorkloadConfig, load_workload

log = logging.getLogger("hf_causal_lm")
LEARNERS = 2


def build_model(seq_len: int) -> torch.nn.Module:
    """The same architecture and initialisation on the syncer and every learner."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=64, n_layer=2, n_head=4)
    return AutoModelForCausalLM.from_config(config)


def text_workload(args: argparse.Namespace):
    """Byte-level windows of the text file: learner shards and a held-out set."""
    cfg = WorkloadConfig(
        factory="ddiloco.workloads.text:make_workload",
        options={"path": str(args.text)},
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        block_bytes=4 * args.seq_len,
        eval_windows=64,
    )
    return load_workload(cfg)


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def as_hf(b) -> dict[str, torch.Tensor]:
    """A ddiloco Batch (inputs, next-byte targets) as the dict a Hugging Face model takes."""
    return {"input_ids": b.inputs, "attention_mask": torch.ones_like(b.inputs), "labels": b.targets}


def config(args: argparse.Namespace) -> ddiloco.Config:
    """The run's config, the same for syncer and learners: the syncer ends the run (with a final
    sync) once the fleet's merged tokens reach the budget; a day is only a safety cap."""
    total = args.steps * LEARNERS * args.batch_size * args.seq_len  # the run's token budget
    return ddiloco.load_config(
        None, [f"algo.sync_every={args.sync_every}", f"run.processed_tokens={total}", "runtime.duration_s=86400"]
    )


def run_syncer(args: argparse.Namespace) -> None:
    model = build_model(args.seq_len)
    server = ddiloco.SyncerServer(model, args.bind, args.run_dir, config=config(args), keys=args.keys)
    log.info("syncer at %s", server.address)
    server.serve()  # until the run's token budget (or SIGTERM); then writes RUN_DIR/final/model.safetensors


def run_learner(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = build_model(args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    stream = text_workload(args).train_stream(args.id, LEARNERS, 0)
    key = args.keys or Path(args.run_dir) / "keys"  # the syncer makes the run's keys there
    learner = ddiloco.Learner(model, args.syncer, learner_id=args.id, key=key, config=config(args),
                              optimizer=optimizer)  # fmt: skip  # + joins, takes the global model
    stream.seek(learner.data_position)  # a restarted learner resumes its data where the run recorded it
    total = learner.cfg.run.processed_tokens

    def lr_factor(_: int) -> float:  # warm-up, then cosine, over the whole fleet's tokens
        done = min(1.0, learner.fleet_tokens / total)
        return min(1.0, done / 0.05) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    while not learner.run_ended:  # the syncer says when the fleet has trained its budget
        batch = as_hf(stream.next_batch())
        loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        learner.step(tokens=batch["input_ids"].numel(), data_position=stream.position)  # +
        if learner.stats.steps % 50 == 0:
            log.info("learner %d step %d loss %.3f", args.id, learner.stats.steps, loss.item())
    learner.finish()  # + the final sync (the syncer merges what is left), then leave


@torch.no_grad()
def evaluate(model: torch.nn.Module, args: argparse.Namespace) -> float:
    """Token-weighted mean loss (nats per byte) on the text's held-out windows."""
    model.eval()
    batches = text_workload(args).eval_batches()
    total = sum(loss_of(model, as_hf(b)).item() * b.tokens for b in batches)
    return total / sum(b.tokens for b in batches)


def run_all(args: argparse.Namespace) -> float:
    """Syncer and learners as local processes; then evaluate and export the global model."""
    from ddiloco.service.ops.launcher import free_port

    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    common = [sys.executable, __file__, "--text", str(args.text), "--run-dir", str(args.run_dir)]
    common += ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    common += ["--sync-every", str(args.sync_every), "--lr", str(args.lr)]
    common += ["--keys", args.keys] if args.keys else []
    syncer = subprocess.Popen([*common, "--role", "syncer", "--bind", address])
    try:
        status = Path(args.run_dir) / "status" / "syncer-0.json"
        while not status.exists():
            if syncer.poll() is not None:
                raise SystemExit(f"the syncer exited with {syncer.returncode}")
            time.sleep(0.1)
        role = [*common, "--role", "learner", "--syncer", address, "--id"]
        learners = [subprocess.Popen([*role, str(m)]) for m in range(LEARNERS)]
        codes = [p.wait() for p in learners]
        if any(codes):
            raise SystemExit(f"a learner failed: exit codes {codes}")
        syncer.wait(timeout=120)  # it ends the run itself: final sync, final model
    finally:
        if syncer.poll() is None:
            syncer.terminate()
            syncer.wait(timeout=120)
    model = build_model(args.seq_len)
    out = ddiloco.export_model(model, args.run_dir, Path(args.run_dir) / "hf")  # loads the final global model
    loss = evaluate(model, args)
    print(f"eval loss (nats/byte): {loss:.4f}; the model is in {out} (AutoModelForCausalLM.from_pretrained)")
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, required=True, help="a text file to train on (byte-level tokens)")
    ap.add_argument("--role", choices=("all", "syncer", "learner"), default="all")
    ap.add_argument("--run-dir", default="runs/hf_causal_lm", help="the syncer's folder (final model, tape)")
    ap.add_argument("--bind", default="tcp://127.0.0.1:5555", help="syncer: the address to bind")
    ap.add_argument("--syncer", help="learner: the syncer's address")
    ap.add_argument("--id", type=int, default=0, help="learner: its id (0 .. 1), which also picks its data shard")
    ap.add_argument("--keys", help="the `ddiloco keys` folder (default: the syncer makes RUN_DIR/keys)")
    ap.add_argument("--steps", type=int, default=300, help="inner steps per learner in a healthy run")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=24, help="H: inner steps between syncs of a fragment")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(process)d: %(message)s")
    if not args.text.is_file():
        raise SystemExit(f"--text {args.text} is not a file; pass a text file to train on")
    if args.role == "syncer":
        run_syncer(args)
    elif args.role == "learner":
        if not args.syncer:
            raise SystemExit("--role learner needs --syncer tcp://HOST:PORT")
        run_learner(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
