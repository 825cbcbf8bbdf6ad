"""Training speed: saffu's transformer step against the revision before the speed work and
against the same model written in PyTorch (eager and ``torch.compile``), on one core and on both.

Every variant trains the same model (V 8,192, width 128, 5 layers, 4 heads, context 32 + 256
targets, 16 windows a step, AdamW, float32) from the same init on the same batches (the
trainer's own batch schedule over the prepared corpus, or random tokens without one), each in a
process of its own pinned with ``taskset`` (one process at a time), in alternating rounds; the
median seconds per step of the rounds is kept. On both cores saffu runs three ways: one process
(XLA's threads), one process over two forced host devices (``--devices 2``) and two processes,
one pinned to each core, joined by ``jax.distributed`` (``--num-processes 2``). Each variant
reports the mean training loss of its steps and the loss of its final parameters on the first batch, so a speed-up is never a
different computation. XLA's FLOP count of one step gives the achieved GFLOP/s of every variant
(one count for the model, so the GFLOP/s ratios are the speed ratios). saffu's step is also
profiled op by op (the top ops by time).

    python experiments/bench_train.py --before ../saffu-before          # table + --metrics-json
    python experiments/bench_train.py --before ../saffu-before --write-result
    python experiments/bench_train.py --quick                           # small model, one round

``--before DIR`` is a checkout of the revision to compare with (``git worktree add DIR REV``);
without it that row is left out. The PyTorch rows need ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: The model benchmarked: GPT-2's block with an output bias, attention document-local.
GPT_BLOCK = {"block": "gpt", "output_bias": True, "across_documents": False}
#: The model's and the batch's settings: the options every variant reads (and the figures record).
MODEL = ("vocab_size", "width", "layers", "heads", "context", "batch_size", "seq_len")
#: (name, cores): the variants of one round (torch-*: PyTorch's). Cores: "0" one core, "0,1" both.
VARIANTS = (("saffu", "0"), ("saffu-before", "0"), ("torch-eager", "0"), ("torch-compile", "0"),
            ("saffu", "0,1"), ("saffu-dp2", "0,1"), ("saffu-mp2", "0,1"), ("saffu-before", "0,1"),
            ("torch-eager", "0,1"), ("torch-compile", "0,1"))


@dataclasses.dataclass
class Options:
    """The model, the variants and the timing.

    Attributes:
      workdir: a prepared work directory whose training tokens make the batches (random tokens if absent)
      before: a checkout of the revision to compare with (its saffu/ is imported)
      vocab_size: vocabulary size V
      width: model width d
      layers: transformer layers
      heads: attention heads
      context: context tokens before a window's targets
      batch_size: windows per step
      seq_len: targets per window
      warm_steps: untimed steps first (compilation)
      steps: timed steps per variant and round
      rounds: alternating rounds (the median is kept)
      variants: comma-separated names[@cores] to run (default: all), e.g. saffu@1,torch-eager@1,saffu-mp2@2
      quick: a small model, one round (about two minutes)
      metrics_json: also write the figures here
      write_result: write results/bench_train.json
    """

    workdir: Path = ROOT / "runs" / "babylm"
    before: Path | None = None
    vocab_size: int = 8192
    width: int = 128
    layers: int = 5
    heads: int = 4
    context: int = 32
    batch_size: int = 16
    seq_len: int = 256
    warm_steps: int = 8
    steps: int = 6
    rounds: int = 2
    variants: str | None = None
    quick: bool = False
    metrics_json: Path | None = None
    write_result: bool = False


# ------------------------------------------------------------------------------------- children


def _page_faults() -> int:
    """Minor page faults of this process so far (memory touched for the first time)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _saffu_child(spec: dict, batches: np.ndarray, data_parallel: bool, profile: bool,
                 job: tuple[str, int] | None = None) -> dict:
    """One saffu variant (whichever ``saffu`` package is first on the path): seconds per step,
    losses, XLA's FLOPs of the step and, with ``profile``, the top ops of the step by time.
    ``job``: ``(coordinator, process id)`` of a two-process data-parallel job."""
    import jax
    import jax.numpy as jnp

    import saffu
    if job is not None:
        from saffu.engine import distributed
        distributed.initialize(job[0], 2, job[1])
    from saffu.configs import TrainConfig, TransformerConfig
    from saffu.models.interface import model_init, target_loss
    from saffu.training.trainer import StepStats, make_optimizer, make_train_step

    # the gpt block with an output bias, document-local: what a revision from before those choices has alone
    block = {k: v for k, v in GPT_BLOCK.items() if k in TransformerConfig.__dataclass_fields__}
    model = TransformerConfig(spec["vocab_size"], spec["width"], spec["layers"], spec["heads"],
                              context_tokens=spec["context"], **block)
    total = spec["warm_steps"] + spec["steps"]
    config = TrainConfig(steps=total, batch_size=spec["batch_size"], seq_len=spec["seq_len"], warmup_steps=2)
    optimizer = make_optimizer(config, total)
    params = model_init(model, jax.random.key(0))
    opt_state, stats = optimizer.init(params), StepStats.zeros()
    mask = np.ones((spec["batch_size"], spec["seq_len"]), bool)
    put = jax.device_put
    if data_parallel:
        from jax.sharding import NamedSharding, PartitionSpec

        from saffu.engine.distributed import put_global
        from saffu.training.trainer import data_parallel_mesh
        mesh = data_parallel_mesh(None if job else 2)
        replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
        params, opt_state, stats = put_global((params, opt_state, stats), replicated)
        put = lambda x: put_global(np.asarray(x), split)
    # the revision before takes no mesh argument (it runs only on one device here)
    step_fn = make_train_step(model, optimizer, config, mesh) if data_parallel else make_train_step(model, optimizer, config)
    inputs = [(put(jnp.asarray(batches[i % len(batches)])), put(jnp.asarray(mask))) for i in range(total)]
    compiled = step_fn.lower(params, opt_state, stats, jnp.int32(0), *inputs[0], {}).compile()
    cost = compiled.cost_analysis()        # a dict (this project's jax: every revision runs on it)
    for i in range(total):
        if i == spec["warm_steps"]:
            jax.block_until_ready(params)
            start, faults = time.perf_counter(), _page_faults()
        params, opt_state, stats = compiled(params, opt_state, stats, jnp.int32(i), *inputs[i], {})
    jax.block_until_ready(stats)
    seconds = (time.perf_counter() - start) / spec["steps"]
    faults = (_page_faults() - faults) / spec["steps"]
    first = inputs[0]
    if job is not None:    # the final loss on one process's copy of the parameters
        from saffu.engine.distributed import local_copy
        params, first = local_copy(params), (jnp.asarray(batches[0]), jnp.asarray(mask))
    nll, count = jax.jit(lambda p, w, m: target_loss(p, model, w, m))(params, *first)
    result = {"seconds_per_step": seconds, "mean_train_loss": float(stats.loss_sum) / int(stats.applied),
              "final_loss": float(nll) / int(count), "xla_flops": float(cost.get("flops", 0.0)),
              "page_faults_per_step": faults, "devices": len(jax.devices()),
              "package": str(Path(saffu.__file__).resolve().parent)}
    if profile:
        from saffu.eval.bench import op_profile
        state = [params, opt_state, stats]

        def step():     # the first batch again and again
            state[:] = compiled(*state, jnp.int32(0), *inputs[0], {})
            jax.block_until_ready(state[2])
        result["profile"] = op_profile(step, compiled.as_text(), steps=2)
    return result


def _torch_child(spec: dict, batches: np.ndarray, compile_: bool, threads: int) -> dict:
    """The same transformer in PyTorch (a nanoGPT-style module: fused QKV, ``scaled_dot_product_attention``,
    tanh-GELU, pre-norm, learned positions, untied output with a bias), AdamW with the same
    schedule and clipping, started from saffu's init (``spec["init"]``)."""
    import torch

    torch.set_num_threads(threads)
    model = _torch_model(spec, dict(np.load(spec["init"])))
    total = spec["warm_steps"] + spec["steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    warmup = 2
    schedule = lambda i: (i / warmup if i < warmup
                          else 0.5 * (1 + np.cos(np.pi * (i - warmup) / max(total - warmup, 1))))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    context = spec["context"]

    loss_of = lambda module, windows: module(windows[:, :-1], windows[:, context:], context - 1)
    forward = torch.compile(model) if compile_ else model
    windows = [torch.from_numpy(batches[i % len(batches)].astype(np.int64)) for i in range(total)]
    losses = []
    for i in range(total):
        if i == spec["warm_steps"]:
            start, faults = time.perf_counter(), _page_faults()
        loss = loss_of(forward, windows[i])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
    seconds = (time.perf_counter() - start) / spec["steps"]
    faults = (_page_faults() - faults) / spec["steps"]
    with torch.no_grad():
        final = float(loss_of(model, windows[0]))
    return {"seconds_per_step": seconds, "mean_train_loss": float(torch.stack(losses).mean()), "final_loss": final,
            "page_faults_per_step": faults, "torch": torch.__version__, "threads": threads}


def _torch_model(spec: dict, init: dict):
    """The PyTorch module with saffu's initial weights (flax's ``[in, out]`` kernels transposed)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads, eod = spec["width"], spec["heads"], spec["eod_id"]
    tensor = lambda name: torch.from_numpy(np.ascontiguousarray(init[name]))

    def loaded(layer, weight, bias):
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        return layer

    def linear(kernel, bias):       # a [in, …, out] kernel (its out dims those of the bias) as a [out, in] weight
        bias = bias.reshape(-1)
        kernel = kernel.reshape(-1, len(bias))
        return loaded(nn.Linear(*kernel.shape), kernel.T, bias)

    dense = lambda prefix: linear(tensor(f"{prefix}/kernel"), tensor(f"{prefix}/bias"))
    norm = lambda prefix: loaded(nn.LayerNorm(d, eps=1e-6), tensor(f"{prefix}/scale"), tensor(f"{prefix}/bias"))

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            p = f"blocks/{i}"
            qkv = [f"{p}/attention/{n}" for n in ("query", "key", "value")]
            self.ln_1, self.ln_2 = norm(f"{p}/attention_norm"), norm(f"{p}/mlp_norm")
            self.attn = linear(torch.cat([tensor(f"{q}/kernel").reshape(d, d) for q in qkv], 1),
                               torch.cat([tensor(f"{q}/bias").reshape(d) for q in qkv]))
            self.proj, self.fc, self.fc_out = (dense(f"{p}/{n}") for n in ("attention/out", "mlp_in", "mlp_out"))

        def forward(self, x, mask):
            b, s, _ = x.shape
            q, k, v = self.attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (t.view(b, s, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
            return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding.from_pretrained(tensor("embed/embedding"), freeze=False)
            self.positions = nn.Parameter(tensor("positions"))
            self.blocks = nn.ModuleList(Block(i) for i in range(spec["layers"]))
            self.ln_f = norm("final_norm")
            self.head = dense("output")

        def forward(self, tokens, targets, predict_from):
            s = tokens.shape[1]
            boundaries = torch.cumsum(tokens == eod, dim=1)
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            mask = ((boundaries[:, :, None] == boundaries[:, None, :]) & causal)[:, None]
            x = self.embed(tokens) + self.positions[:s]
            for block in self.blocks:
                x = block(x, mask)
            logits = self.head(self.ln_f(x[:, predict_from:]))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def child(name: str, spec_path: str, process_id: int = 0, coordinator: str | None = None) -> None:
    """One variant's process (:func:`_run_child`): its figures printed (by process 0) as the
    ``RESULT <json>`` line that :func:`saffu.eval.bench.run_pinned` reads (printed here: the
    process imports no saffu but its variant's)."""
    spec = json.loads(Path(spec_path).read_text())
    batches = np.load(spec["batches"])
    if name.startswith("torch"):
        result = _torch_child(spec, batches, name == "torch-compile", spec["threads"])
    else:
        job = (coordinator, process_id) if name == "saffu-mp2" else None
        result = _saffu_child(spec, batches, name in ("saffu-dp2", "saffu-mp2"), spec.get("profile", False), job)
    if process_id == 0:
        print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------- parent


def _prepare(args, folder: Path) -> dict:
    """Write the batches (``[steps, B, context + T]`` int32) and saffu's init (flattened names)
    that every variant reads; return the spec."""
    import jax

    from saffu.configs import TrainConfig, TransformerConfig
    from saffu.data.tokenizer import EOD_ID
    from saffu.interop.init import path_name
    from saffu.models.interface import model_init
    from saffu.training.trainer import BatchSchedule

    model = TransformerConfig(args.vocab_size, args.width, args.layers, args.heads, context_tokens=args.context,
                              **GPT_BLOCK)
    total = args.warm_steps + args.steps
    if (args.workdir / "meta.json").exists():
        from saffu.data.workdir import open_workdir
        work = open_workdir(args.workdir)
        if work.vocab_size != args.vocab_size:
            raise SystemExit(f"{args.workdir} has {work.vocab_size:,} tokens, not --vocab-size {args.vocab_size:,}")
        stream = np.asarray(work.tokens(work.train_split))
        source = f"{args.workdir} ({work.train_split})"
    else:
        stream = np.random.default_rng(0).integers(2, args.vocab_size, 200_000).astype(np.int32)
        source = "random tokens"
    schedule = BatchSchedule(stream, model, TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len))
    batches = np.stack([np.asarray(schedule(i)[0]) for i in range(total)]).astype(np.int32)
    np.save(folder / "batches.npy", batches)
    leaves = jax.tree_util.tree_flatten_with_path(model_init(model, jax.random.key(0)))[0]
    np.savez(folder / "init.npz", **{path_name(path): np.asarray(leaf) for path, leaf in leaves})    # flattened names
    return {**{k: getattr(args, k) for k in (*MODEL, "warm_steps", "steps")}, "eod_id": EOD_ID,
            "backend": jax.default_backend(), "batches": str(folder / "batches.npy"),
            "init": str(folder / "init.npz"), "data": source}


def _run_child(name: str, cores: str, spec: dict, folder: Path, before: Path | None, profile: bool = False) -> dict:
    """One variant in its own process pinned to ``cores`` (``saffu-mp2``: one process per core)."""
    from saffu.eval import bench
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps({**spec, "threads": len(cores.split(",")), "profile": profile}))
    # the process calls child() and parses no flags, so it imports its variant's saffu only (the
    # revision before's; none for PyTorch, whose host allocator saffu's import would set)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["PYTHONPATH"], cwd = str(ROOT / "experiments"), ROOT
    if name == "saffu-before":
        env["PYTHONPATH"], cwd = os.pathsep.join([str(before.resolve()), env["PYTHONPATH"]]), before
    if name == "saffu-dp2":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

    # saffu-mp2: one process per core, joined by jax.distributed
    from saffu.engine.distributed import local_coordinator
    pinned, job = (cores.split(","), [local_coordinator()]) if name == "saffu-mp2" else ([cores], [])
    # child(name, spec, process id[, coordinator]) in a fresh Python
    commands = [bench.python_call("bench_train", "child", name, str(spec_path), i, *job) for i in range(len(pinned))]
    return bench.run_pinned(commands, pinned, cwd=cwd, env=env)


def _wanted(args, torch_ok: bool) -> list[tuple[str, str]]:
    """The variants of :data:`VARIANTS` that --variants names (all without it) and that can run here."""
    chosen = [v.split("@") for v in args.variants.split(",")] if args.variants else None
    return [(n, c) for n, c in VARIANTS
            if (chosen is None or any(n == w[0] and (len(w) == 1 or int(w[1]) == len(c.split(","))) for w in chosen))
            and (args.before or n != "saffu-before") and (torch_ok or not n.startswith("torch"))
            and (os.cpu_count() >= 2 or c == "0")]


def main(argv=None) -> int:
    # imported here, not at the top: a variant's process (:func:`child`) imports its own saffu
    from saffu.eval import bench
    from saffu.flags import script_options
    args = script_options(Options, argv, __doc__.splitlines()[0])
    if args.quick:
        args.vocab_size, args.width, args.layers, args.seq_len, args.batch_size = 2048, 64, 2, 64, 8
        args.steps, args.rounds, args.workdir = 3, 1, Path("/nonexistent")
    if args.before and not (args.before / "saffu" / "__init__.py").exists():
        raise SystemExit(f"--before {args.before}: no saffu/ package there (make one with `git worktree add DIR REV`)")
    torch_ok = importlib.util.find_spec("torch") is not None
    if not torch_ok:
        print("PyTorch is not installed (pip install -e '.[bench]'): its rows are left out")
    watch = bench.Watch()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec = _prepare(args, folder)
        runs = bench.in_rounds(
            {row: functools.partial(_run_child, *row, spec, folder, args.before) for row in _wanted(args, torch_ok)},
            args.rounds, lambda i, row, result: print(
                f"round {i}/{args.rounds} {row[0]:>14} cores {row[1]:>3}: "
                f"{result['seconds_per_step'] * 1e3:8.1f} ms/step, final loss {result['final_loss']:.5f}, "
                f"{result['page_faults_per_step']:,.0f} page faults/step", flush=True))
        profile = (_run_child("saffu", "0", spec, folder, None, profile=True)["profile"]
                   if ("saffu", "0") in runs else [])
    figures = _figures(args, spec, runs, profile)
    load = watch.load()
    print("\n" + bench.table(figures["rows"], [
        ("variant", "variant", ""), ("cores", "cores", "d"), ("ms/step", lambda r: r["seconds_per_step"] * 1e3, ".1f"),
        ("tokens/s", "tokens_per_s", ",.0f"), ("per core", "tokens_per_s_per_core", ",.0f"),
        ("GFLOP/s", "gflops_per_s", ".1f"), ("train loss", "mean_train_loss", ".5f"),
        ("final loss", "final_loss", ".5f")], width=9))
    for key in ("speedup_vs_before", "speedup_vs_torch", "speedup_two_cores"):
        print(f"{key}: {figures[key]:.2f}" if figures[key] else f"{key}: not measured")
    if figures["profile"]:
        print("\nsaffu's step, top ops (one core):\n" + bench.op_text(figures["profile"]))
    print(f"load: {load}")
    from saffu._io import write_metrics
    write_metrics(args.metrics_json, {k: v for k, v in figures.items() if isinstance(v, (int, float))})
    if args.write_result:
        from saffu.runner import write_result
        print(f"wrote {write_result(ROOT / 'results', 'bench_train', figures, seeds=[0], load=load)}")
    return 0


def _figures(args, spec: dict, runs: dict, profile: list[dict]) -> dict:
    from saffu.eval.bench import median_row, ratio
    tokens = args.batch_size * args.seq_len
    # XLA's cost analysis counts a loop's body once, and today's step runs its output layer and
    # attention in loops over chunks and windows: the count of the plain step (the revision
    # before, where it ran) is the model's whole computation
    counted = [(r["xla_flops"], n) for name in ("saffu-before", "saffu") for (n, _), rs in runs.items() if n == name
               for r in rs if r.get("xla_flops")]
    flops, flops_from = counted[0] if counted else (None, None)
    rows = []
    for (name, cores), results in runs.items():
        median, count = median_row(results, ["seconds_per_step"]), len(cores.split(","))
        seconds = median["seconds_per_step"]
        rows.append({"variant": name, "cores": count, "seconds_per_step": seconds,
                     "seconds_per_step_rounds": median["per_round"]["seconds_per_step"],
                     "tokens_per_s": tokens / seconds, "tokens_per_s_per_core": tokens / seconds / count,
                     "gflops_per_s": flops / seconds / 1e9 if flops else None,
                     "own_xla_flops": results[0].get("xla_flops"),
                     "mean_train_loss": results[-1]["mean_train_loss"], "final_loss": results[-1]["final_loss"],
                     "page_faults_per_step": median["page_faults_per_step"]})
    speed = {(r["variant"], r["cores"]): r["tokens_per_s"] for r in rows}
    best = lambda *keys: max(((speed[k], k[0]) for k in keys if k in speed), default=(None, None))
    reference = next((r["final_loss"] for r in rows if (r["variant"], r["cores"]) == ("saffu", 1)), None)
    two_cores = best(("saffu", 2), ("saffu-dp2", 2), ("saffu-mp2", 2))
    return {"speedup_vs_before": ratio(speed.get(("saffu", 1)), speed.get(("saffu-before", 1))),
            "speedup_vs_torch": ratio(speed.get(("saffu", 1)), best(("torch-eager", 1), ("torch-compile", 1))[0]),
            "speedup_two_cores": ratio(two_cores[0], speed.get(("saffu", 1))), "best_two_core_variant": two_cores[1],
            "max_final_loss_difference": max((abs(r["final_loss"] - reference) for r in rows), default=None)
            if reference is not None else None,
            "xla_flops_per_step": flops, "xla_flops_from": flops_from, "tokens_per_step": tokens,
            "model": {k: spec[k] for k in MODEL},
            "backend": spec["backend"], "data": spec["data"],
            "steps": {"warm": args.warm_steps, "timed": args.steps, "rounds": args.rounds},
            "rows": rows, "profile": profile}


if __name__ == "__main__":
    from saffu.flags import script_main  # here: a variant's process imports its own saffu
    script_main(main)
