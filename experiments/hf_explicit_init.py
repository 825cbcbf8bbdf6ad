"""Explicit init outside JAX: a Hugging Face checkpoint from ``saffu init-weights --hf-config``
(the explicit embeddings and output kernel, the rest random) trained in PyTorch against the same
checkpoint with every weight random (``--random``: the same draw for the rest), for the same
steps on the same batches; dev bits per byte of both after each evaluation.

Needs torch and transformers (``pip install -e '.[hf]'``). CPU, a small model:

    python experiments/hf_explicit_init.py --workdir runs/babylm --arch llama --write-result
    python experiments/hf_explicit_init.py --workdir runs/quick --quick      # a check: seconds, a tiny model
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np

from saffu.data.workdir import open_workdir
from saffu.flags import flags_of, script_main, script_options
from saffu.runner import prepared, run_saffu, write_result

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Options:
    """The model, its training and the result file.

    Attributes:
      workdir: a prepared work directory
      out: where checkpoints go
      arch: the Hugging Face architecture
      width: model width
      layers: transformer blocks
      heads: attention heads
      steps: training steps of each start
      batch_size: windows per step
      seq_len: targets per window
      learning_rate: peak learning rate (AdamW, warm-up then cosine)
      eval_every: steps between dev evaluations
      eval_tokens: dev tokens (whole documents) per evaluation
      seed: seed of the random weights and the batches
      threads: torch threads
      quick: a tiny model on the embedded corpus (a check)
      write_result: write results/hf_explicit_init.json
    """

    workdir: Path = ROOT / "runs" / "babylm"
    out: Path = ROOT / "runs" / "hf_explicit_init"
    arch: str = dataclasses.field(default="llama", metadata={"choices": ("llama", "gpt2")})
    width: int = 128
    layers: int = 2
    heads: int = 4
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = 3e-3
    eval_every: int = 100
    eval_tokens: int = 100_000
    seed: int = 0
    threads: int = 1
    quick: bool = False
    write_result: bool = False


def make_checkpoint(args, random: bool) -> Path:
    out = args.out / ("random" if random else "explicit")
    if not (out / "model.safetensors").exists():
        run_saffu("init-weights", *flags_of({"workdir": args.workdir, "rank": args.width, "layers": args.layers,
                                             "attention_heads": args.heads, "max_len": args.seq_len + 1,
                                             "hf_config": args.arch, "seed": args.seed, "out": out}),
                  *(["--random"] if random else []))
    return out


def dev_windows(workdir, tokens: int, seq_len: int) -> tuple[list[np.ndarray], int]:
    """Dev windows of whole documents (each up to ``seq_len + 1`` tokens: the token before the
    first target, then the targets) and the bytes of their text."""
    stream = np.asarray(workdir.tokens("dev"))
    ranges, info = workdir.sample_documents("dev", tokens)
    windows = [stream[s - 1:min(s + seq_len, end)] for begin, end in ranges for s in range(begin, end, seq_len)]
    return windows, info["bytes"]


def bits_per_byte(model, windows, n_bytes: int, torch) -> float:
    total = 0.0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(windows), 32):
            batch = windows[start:start + 32]
            width = max(len(w) for w in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width - 1), dtype=torch.bool)
            for i, w in enumerate(batch):
                ids[i, :len(w)] = torch.from_numpy(w.astype(np.int64))
                mask[i, :len(w) - 1] = True
            logits = model(ids[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            total += float(nll[mask].sum())
    model.train()
    return total / math.log(2) / n_bytes


def train(args, path: Path, torch, transformers, windows, n_bytes) -> list[dict]:
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    warmup = min(50, args.steps // 2)
    schedule = lambda step: (step + 1) / warmup if step < warmup else \
        0.5 * (1 + math.cos(math.pi * (step - warmup) / max(args.steps - warmup, 1)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    stream = np.asarray(open_workdir(args.workdir).tokens(open_workdir(args.workdir).train_split))
    rng = np.random.default_rng(args.seed)                        # the same batches for both starts
    history = [{"step": 0, "dev_bpb": bits_per_byte(model, windows, n_bytes, torch), "seconds": 0.0}]
    print(f"{path.name}: step 0 dev {history[-1]['dev_bpb']:.4f} bits/byte", flush=True)
    tick, elapsed = time.perf_counter(), 0.0              # training seconds, evaluations excluded
    for step in range(args.steps):
        starts = rng.integers(0, len(stream) - args.seq_len - 1, args.batch_size)
        batch = torch.from_numpy(np.stack([stream[s:s + args.seq_len + 1] for s in starts]).astype(np.int64))
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            elapsed += time.perf_counter() - tick
            history.append({"step": step + 1, "train_loss": loss.item(), "seconds": elapsed,
                            "dev_bpb": bits_per_byte(model, windows, n_bytes, torch)})
            print(f"{path.name}: step {step + 1} dev {history[-1]['dev_bpb']:.4f} bits/byte "
                  f"(train loss {loss.item():.3f}, {elapsed:.0f} s)", flush=True)
            tick = time.perf_counter()
    return history


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    try:
        import torch
        import transformers
    except ModuleNotFoundError as err:
        raise SystemExit(f"this experiment trains in PyTorch ({err}); pip install -e '.[hf]'") from None
    if args.quick:
        args.width, args.layers, args.heads, args.steps, args.seq_len, args.batch_size = 32, 1, 2, 20, 32, 4
        args.eval_every, args.eval_tokens = 10, 2000
        prepared(args.workdir)
    torch.set_num_threads(args.threads)
    workdir = open_workdir(args.workdir)
    windows, n_bytes = dev_windows(workdir, args.eval_tokens, args.seq_len)
    curves = {}
    for start, random in (("explicit", False), ("random", True)):
        curves[start] = train(args, make_checkpoint(args, random), torch, transformers, windows, n_bytes)
    gap = curves["random"][-1]["dev_bpb"] - curves["explicit"][-1]["dev_bpb"]
    print(f"after {args.steps} steps: explicit {curves['explicit'][-1]['dev_bpb']:.4f}, random "
          f"{curves['random'][-1]['dev_bpb']:.4f} bits/byte (explicit better by {gap:.4f})")
    figures = {"arch": args.arch, "corpus": workdir.meta["corpus"], "width": args.width, "layers": args.layers,
               "heads": args.heads, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
               "learning_rate": args.learning_rate, "eval_tokens": args.eval_tokens, "curves": curves,
               "explicit_gain_bpb": gap, "torch": torch.__version__, "transformers": transformers.__version__}
    print(json.dumps({"explicit_gain_bpb": gap}))
    if args.write_result:
        print(f"wrote {write_result(ROOT / 'results', 'hf_explicit_init', figures, seeds=[args.seed])}")
    return 0


if __name__ == "__main__":
    script_main(main)
