"""Deep SAFFU stacks: explicit solutions of 1 … L blocks, warm and cold training, attention
profiles, and Inheritune with blocks solved on top of a trained stack.

Parts (``--part``), each skipping what a previous run of it already finished, so several
processes (one per core) can share ``--out``:

* ``explicit``: one explicit solve of the deepest stack (``--blocks``'s largest). Blocks are solved
  in order, each reading only the blocks under it, so the stack of its first ``L`` blocks *is*
  the explicit ``L``-block solution (tested in ``tests/test_inheritune.py``); each ``L`` of
  ``--blocks`` is saved as a ``saffu fit``-style run, scored on dev and its attention profiled
  (:mod:`saffu.eval.attention`), with the holdout loss the solver reached at every depth. A
  rerun with a larger ``--blocks`` solves only the new blocks, on top of the saved stack. Each
  block's statistics passes rerun every block under it, so a block's solve time grows with
  its depth (the report lists it).
* ``train``: each ``L`` of ``--train-blocks`` trained one epoch from the explicit solution
  (``warm``) and from random init (``cold``): same trainer, learning rate, batches and seed.
* ``inheritune``: the first ``L/2`` blocks of a trained ``L``-block reference (``--reference``,
  default: the warm ``L = max(--train-blocks)`` run) trained one epoch, then grown one block at a
  time — a block solved explicitly on top of the trained stack (``--grow-by solve``,
  :func:`saffu.solve.stack.solve_explicit` with ``below``) or the reference's next block
  (``reference``) — each stage one more epoch, until its dev loss is at or below the
  reference's or it has the reference's depth. The same small stack trained from explicit and
  random init is the ``train`` part's ``L/2`` runs (equal training tokens per stage).

``--report`` gathers everything into ``report.json``, ``report.md`` and ``deep_saffu.png``
(dev bits/byte against depth; attention rank and first-key share per block).

    python experiments/deep_saffu.py --workdir runs/babylm --out runs/deep_saffu --part explicit
    python experiments/deep_saffu.py --workdir runs/babylm --out runs/deep_saffu --part train --starts warm
    python experiments/deep_saffu.py --workdir runs/babylm --out runs/deep_saffu --part train --starts cold
    python experiments/deep_saffu.py --workdir runs/babylm --out runs/deep_saffu --part inheritune
    python experiments/deep_saffu.py --out runs/deep_saffu --report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from saffu.models.interface import model_init

STARTS = ("warm", "cold")


def _config(args, source, blocks: int):
    from saffu.configs import SaffuConfig
    return SaffuConfig(source.vocab_size, radius=args.radius, bits=args.bits, positions=args.positions,
                       blocks=blocks)


def _profile(args, source, params, config) -> dict:
    from saffu.eval.attention import inspect_attention
    profile = inspect_attention(params, config, source.tokens("dev"), windows=args.inspect_windows)
    return {"max_rank": [layer["max_rank"] for layer in profile["layers"]],
            "top_column_share": [max(head["top_column_share"] for head in layer["heads"]) for layer in profile["layers"]],
            "first_key_share": [layer["mean_first_key_share"] for layer in profile["layers"]],
            "first_key_share_if_uniform": profile["first_key_share_if_uniform"],
            "window_tokens": profile["window_tokens"], "lazy_layers": profile["lazy_layers"],
            "top_offset_weight": [layer["mean_top_weight"] for layer in profile["offsets"]],
            "mean_by_offset": [layer["heads"][0]["mean_by_offset"] for layer in profile["offsets"]]}


def _scores(args, source, params, config) -> dict:
    from saffu.eval.scoring import evaluate_split
    return evaluate_split(params, config, source, "dev", args.eval_tokens or None, progress=False)


def explicit_part(args, source) -> None:
    """Solve the deepest stack once; save, score and profile every prefix in ``--blocks``."""
    from saffu.models.interface import parameter_count
    from saffu.models.saffu import inherit_blocks
    from saffu.solve.stack import solve_explicit
    from saffu.training.checkpoints import load_explicit, save_explicit_run
    deepest = _config(args, source, max(args.blocks))
    root = args.out / "explicit"
    record = root / "solve.json"
    solve = json.loads(record.read_text()) if record.exists() else {"blocks": 0, "seconds": 0.0}
    if solve["blocks"] >= deepest.blocks:
        params = inherit_blocks(load_explicit(root / f"L{solve['blocks']}", _config(args, source, solve["blocks"])),
                                _config(args, source, solve["blocks"]), deepest.blocks)[1]
    else:       # solve the stack, or the blocks above an earlier, shallower solve (the same blocks)
        below = (load_explicit(root / f"L{solve['blocks']}", _config(args, source, solve["blocks"]))
                 if solve["blocks"] else None)
        params, more = solve_explicit(source, deepest, progress=not args.quiet, below=below)
        solve = {**solve, **{k: v for k, v in more.items() if k.startswith("block") or k.startswith("seconds_")},
                 "blocks": deepest.blocks, "seconds": solve["seconds"] + more["seconds"]}
        for blocks in sorted(set(args.blocks)):
            config, prefix = inherit_blocks(params, deepest, blocks)
            if not (root / f"L{blocks}" / "config.json").exists():
                save_explicit_run(root / f"L{blocks}", config, source, prefix)
        record.write_text(json.dumps(solve))
    for blocks in sorted(set(args.blocks)):
        path = root / f"L{blocks}" / "result.json"
        if path.exists():
            continue
        config, prefix = inherit_blocks(params, deepest, blocks)
        tick = time.perf_counter()
        scores = _scores(args, source, prefix, config)
        result = {"start": "explicit", "blocks": blocks, "params": parameter_count(prefix),
                  "holdout_loss": solve[f"block{blocks - 1}_holdout_loss"], "eval_seconds": time.perf_counter() - tick,
                  "attention": _profile(args, source, prefix, config), **scores}
        path.write_text(json.dumps(result))
        print(f"explicit, {blocks} blocks: dev {scores['dev_bpb']:.4f} bits/byte, holdout loss "
              f"{result['holdout_loss']:.4f}", flush=True)


def _train(args, source, config, params, run: Path, label: dict, solve_seconds: float = 0.0) -> dict:
    """One epoch of ``params`` in ``run`` (a CLI run: saffu eval / inspect / blimp take it), scored."""
    from saffu.configs import TrainConfig
    from saffu.models.interface import parameter_count
    from saffu.training.checkpoints import save_run_config
    from saffu.training.trainer import train
    run.mkdir(parents=True, exist_ok=True)
    save_run_config(run, config, source)
    train_config = TrainConfig(learning_rate=args.learning_rate, seed=args.seed, eval_every=args.eval_every,
                               checkpoint_every=0)
    trained, history = train(config, params, source.tokens(source.train_split), train_config, run,
                             dev_stream=source.tokens("dev"), progress=not args.quiet)
    scores = _scores(args, source, trained, config)
    result = {**label, "blocks": config.blocks, "params": parameter_count(trained),
              "train_tokens": history[-1]["tokens"], "train_seconds": history[-1]["seconds"],
              "flops": history[-1]["flops"], "solve_seconds": solve_seconds, "history": history,
              "attention": _profile(args, source, trained, config), **scores}
    (run / "result.json").write_text(json.dumps(result))
    print(f"{label['start']}, {config.blocks} blocks: dev {scores['dev_bpb']:.4f} bits/byte "
          f"({history[-1]['seconds']:.0f} s training)", flush=True)
    return result


def train_part(args, source) -> None:
    import jax

    from saffu.training.checkpoints import load_explicit
    for blocks in args.train_blocks:
        config = _config(args, source, blocks)
        for start in args.starts:
            run = args.out / "runs" / f"{start}_L{blocks}"
            if (run / "result.json").exists():
                continue
            if start == "warm":
                if not (args.out / "explicit" / f"L{blocks}").exists():
                    raise SystemExit(f"no explicit {blocks}-block stack in {args.out}/explicit: run --part explicit "
                                     f"with {blocks} in --blocks first")
                params = load_explicit(args.out / "explicit" / f"L{blocks}", config)
            else:
                params = model_init(config, jax.random.fold_in(jax.random.key(args.seed), 0))
            _train(args, source, config, params, run, {"start": start})


def _result(path: Path) -> dict | None:
    return json.loads((path / "result.json").read_text()) if (path / "result.json").exists() else None


def inheritune_part(args, source) -> None:
    from saffu.models.saffu import grow_block, inherit_blocks
    from saffu.solve.stack import solve_explicit
    from saffu.training.checkpoints import load_params, load_run_config
    reference_run = args.reference or args.out / "runs" / f"warm_L{max(args.train_blocks)}"
    reference_result = _result(reference_run)
    if reference_result is None:
        raise SystemExit(f"{reference_run} has no result.json: train the reference first (--part train)")
    reference = load_run_config(reference_run)
    reference_params = load_params(reference_run, reference)[0]
    blocks = args.inherit_blocks or max(1, reference.blocks // 2)
    config, params = inherit_blocks(reference_params, reference, blocks)
    label = {"start": f"inherit ({args.grow_by})", "reference": str(reference_run),
             "reference_dev_loss": reference_result["dev_loss"], "reference_dev_bpb": reference_result["dev_bpb"]}
    stage = args.out / "runs" / f"inherit-{args.grow_by}_L{blocks}"
    result = _result(stage) or _train(args, source, config, params, stage, label)
    while result["dev_loss"] > reference_result["dev_loss"] and result["blocks"] < reference.blocks:
        previous, stage = stage, args.out / "runs" / f"inherit-{args.grow_by}_L{result['blocks'] + 1}"
        done = _result(stage)
        if done is None:
            small = load_run_config(previous)
            trained = load_params(previous, small)[0]
            tick = time.perf_counter()
            if args.grow_by == "solve":
                grown, _ = solve_explicit(source, dataclasses.replace(small, blocks=small.blocks + 1),
                                          progress=not args.quiet, below=trained)
                config, params = grow_block(trained, small, grown["blocks"][small.blocks])
            else:
                config, params = grow_block(trained, small, reference_params["blocks"][small.blocks])
            done = _train(args, source, config, params, stage, label, solve_seconds=time.perf_counter() - tick)
        result = done


def backfill_offsets(args, source) -> None:
    """Redo the attention profile of finished results made without the offset profile
    (:func:`saffu.eval.attention.offset_profile`)."""
    from saffu.training.checkpoints import load_params, load_run_config
    for path in sorted((args.out / "explicit").glob("L*")) + sorted((args.out / "runs").glob("*")):
        result = _result(path)
        if result is None or "top_offset_weight" in result["attention"]:
            continue
        config = load_run_config(path)
        result["attention"] = _profile(args, source, load_params(path, config)[0], config)
        (path / "result.json").write_text(json.dumps(result))


def report(args) -> None:
    """``report.md``, ``report.json`` and ``deep_saffu.png`` of everything finished."""
    explicit = sorted((r for r in (_result(p) for p in (args.out / "explicit").glob("L*")) if r),
                      key=lambda r: r["blocks"])
    trained = sorted((r for r in (_result(p) for p in (args.out / "runs").glob("*")) if r),
                     key=lambda r: (r["start"], r["blocks"]))
    solve = json.loads((args.out / "explicit" / "solve.json").read_text()) if explicit else {}
    rows = ["| start | blocks | params | training tokens (cumulative) | dev loss | dev bits/byte | "
            "max attention rank per block (of window) | largest column share per block | first-key share per block | "
            "mean top-offset weight per block | lazy |",
            "|---|---:|---:|---:|---:|---:|---|---|---|---|---|"]
    for r in explicit + trained:
        a = r["attention"]
        tokens = sum(x["train_tokens"] for x in trained if x["start"] == r["start"] and x["blocks"] <= r["blocks"]
                     ) if r["start"].startswith("inherit") else r.get("train_tokens", 0)
        rows.append(f"| {r['start']} | {r['blocks']} | {r.get('params', 0):,} | {tokens:,} | {r['dev_loss']:.4f} | "
                    f"{r['dev_bpb']:.4f} | {' '.join(map(str, a['max_rank']))} (of {a['window_tokens']}) | "
                    f"{' '.join(f'{x:.2f}' for x in a['top_column_share'])} | "
                    f"{' '.join(f'{x:.2f}' for x in a['first_key_share'])} (uniform {a['first_key_share_if_uniform']:.2f})"
                    f" | {' '.join(f'{x:.2f}' for x in a['top_offset_weight']) if 'top_offset_weight' in a else '—'}"
                    f" | {a['lazy_layers'] or 'none'} |")
    depth = [f"| {i + 1} | {solve[f'block{i}_holdout_loss']:.4f} | "
             f"{sum(v for k, v in solve.items() if k.startswith(f'seconds_block{i}_')):.1f} |"
             for i in range(max([r["blocks"] for r in explicit], default=0))]
    table = "\n".join(rows)
    text = table + ("\n\nexplicit solve of the deepest stack: holdout loss after each block\n\n"
                    "| block | holdout loss (nats/token) | solve seconds of the block (statistics passes + calibration) |"
                    "\n|---:|---:|---:|\n" + "\n".join(depth)
                    + f"\n\nsolve seconds (all blocks): {solve.get('seconds', float('nan')):.1f}\n" if explicit else "\n")
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps({"solve": solve, "explicit": explicit, "trained": [
        {k: v for k, v in r.items() if k != "history"} for r in trained]}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2))
    colours = {"explicit": "tab:blue", "warm": "tab:green", "cold": "tab:gray"}
    for start in ("explicit", *STARTS):
        rs = [r for r in explicit + trained if r["start"] == start]
        if rs:
            left.plot([r["blocks"] for r in rs], [r["dev_bpb"] for r in rs], "o-", color=colours[start], label=start)
    inherit = [r for r in trained if r["start"].startswith("inherit")]
    if inherit:
        left.plot([r["blocks"] for r in inherit], [r["dev_bpb"] for r in inherit], "s--", color="tab:red",
                  label=inherit[0]["start"] + " (one epoch per stage)")
    left.set_xscale("log", base=2)
    left.set_xlabel("blocks")
    left.set_ylabel("dev bits/byte")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    for r in explicit + trained:
        if r["blocks"] != max(x["blocks"] for x in explicit + trained if x["start"] == r["start"]):
            continue
        layers = np.arange(1, r["blocks"] + 1)
        style = dict(color=colours.get(r["start"], "tab:red"), marker="o", label=f"{r['start']}, {r['blocks']} blocks")
        middle.plot(layers, r["attention"]["max_rank"], **style)
        if "top_offset_weight" in r["attention"]:
            right.plot(layers, r["attention"]["top_offset_weight"], **style)
    middle.set_xlabel("block")
    middle.set_ylabel("max effective rank over heads (90% energy)")
    right.set_xlabel("block")
    right.set_ylabel("mean weight on each query's top offset")
    right.axhline(1 / args.radius, color="black", linestyle=":", label="uniform over the offsets")
    right.axhline(1.0, color="black", linestyle="--", linewidth=0.8, label="collapsed onto one offset")
    for axis in (middle, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.out / "deep_saffu.png", dpi=110)
    plt.close(figure)
    print(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="a prepared work directory (not needed for --report)")
    parser.add_argument("--out", type=Path, default=Path("runs/deep_saffu"))
    parser.add_argument("--part", choices=["explicit", "train", "inheritune", "offsets"], action="append",
                        help="what to run (repeatable; default: explicit, train, inheritune in order; offsets: "
                             "redo the attention profile of results made without the offset profile)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="stack depths of the explicit part (one solve of the deepest)")
    parser.add_argument("--train-blocks", type=int, nargs="+", default=[2, 4], help="stack depths trained warm and cold")
    parser.add_argument("--starts", nargs="+", choices=STARTS, default=list(STARTS))
    parser.add_argument("--reference", type=Path, help="Inheritune's trained reference (default: warm_L<max train-blocks>)")
    parser.add_argument("--inherit-blocks", type=int, help="blocks the inherited stack starts with (default: half)")
    parser.add_argument("--grow-by", choices=["solve", "reference"], default="solve",
                        help="a grown block: solved explicitly on top of the trained stack, or the reference's")
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="share of the training split (whole documents; the dev split stays whole)")
    parser.add_argument("--radius", type=int, default=8)
    parser.add_argument("--bits", type=int, default=128)
    parser.add_argument("--positions", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=0.003)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-tokens", type=int, default=0, help="dev tokens of each score (0: the whole split)")
    parser.add_argument("--inspect-windows", type=int, default=64, help="dev windows of the attention profile")
    parser.add_argument("--report", action="store_true", help="only gather what is finished")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        if args.workdir is None:
            parser.error("--workdir is needed unless --report")
        if min(args.blocks + args.train_blocks) < 1:
            parser.error("--blocks and --train-blocks must be ≥ 1")
        if not 0 < args.fraction <= 1:
            parser.error("--fraction must be in (0, 1]")
        from saffu.data.workdir import open_workdir, subset_workdir
        source = open_workdir(args.workdir)
        if args.fraction < 1:            # whole documents from evenly spaced blocks; dev unchanged
            subset = args.out / "data"
            source = (open_workdir(subset) if (subset / "meta.json").exists()
                      else subset_workdir(source, subset, train_fraction=args.fraction))
        for part in args.part or ["explicit", "train", "inheritune"]:
            {"explicit": explicit_part, "train": train_part, "inheritune": inheritune_part,
             "offsets": backfill_offsets}[part](args, source)
    report(args)


if __name__ == "__main__":
    main()
