"""BLiMP the way the field scores it: lm-evaluation-harness (the ``saffu`` harness model, local
task configs of the shared paradigms) against ``saffu blimp`` on the same runs, and — for a run
that exports — the harness's own Hugging Face model (``--model hf``) on the export.

    python experiments/harness_blimp.py --run cold=runs/tune/runs/cold/1ep_le0.01_we0.9_dr0 \\
        --run explicit=runs/tune/runs/explicit-init/1ep_le0.006_we0_dr0 --blimp ../shared/data/blimp --write-result

``--harness-only`` scores with the harness's ``saffu`` model alone (the figure of every start; the
three-way agreement is shown by the runs scored without it), and ``--merge`` keeps the rows of the
results file that this invocation does not score again (each row keeps the command and date it came from):

    python experiments/harness_blimp.py --harness-only --merge --write-result \
        --run cold-4ep=runs/tune/runs/cold/4ep_le0.01_we0.9_dr0

Needs ``pip install -e '.[eval]'`` (and ``'.[hf]'`` for the Hugging Face model).
"""

from __future__ import annotations

import dataclasses
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

from saffu._io import SaffuError
from saffu.flags import script_main, script_options
from saffu.runner import recorded, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "results" / "harness_blimp.json"


@dataclasses.dataclass
class Options:
    """The runs to score and where the figures go.

    Attributes:
      run: NAME=RUN_FOLDER (repeatable)
      blimp: the BLiMP paradigms (a folder of .jsonl files)
      write_result: write results/harness_blimp.json
      harness_only: the harness's saffu model alone (no saffu blimp, no Hugging Face export)
      merge: keep the results file's rows of runs not named here (with --write-result)
    """

    run: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "action": "append", "type": str, "nargs": None, "default": None, "required": True})
    blimp: Path = ROOT.parent / "shared" / "data" / "blimp"
    write_result: bool = False
    harness_only: bool = False
    merge: bool = False


def score(name: str, run: Path, blimp: Path, tasks: Path, harness_only: bool = False) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from saffu.eval.blimp import evaluate_blimp
    from saffu.interop.harness import SaffuLM
    tick = time.perf_counter()
    model = SaffuLM(run, progress=False, batch_size=None)      # any run folder of saffu train, a penzai model's too
    manager = TaskManager(include_path=str(tasks))
    harness = lm_eval.simple_evaluate(model=model, tasks=["saffu_blimp"], task_manager=manager, log_samples=False,
                                      verbosity="WARNING")["results"]["saffu_blimp"]["acc,none"]
    family = getattr(model.config, "family", None)          # an any_model.py run: a model penzai builds
    row = {"name": name, "run": str(run), "weights": model.weights, "kind": model.config.kind,
           "block": f"penzai {family}" if family else getattr(model.config, "block", None), "harness_saffu": harness}
    if harness_only:
        row["seconds"] = time.perf_counter() - tick
        print(f"{name}: harness {harness:.4f}", flush=True)
        return row
    ours = evaluate_blimp(model.params, model.config, model.tokenizer, blimp, progress=False)["blimp_accuracy"]
    row.update(saffu_blimp=ours, harness_minus_saffu_points=100 * (harness - ours))
    try:
        from saffu.interop.hf import exportable
        exportable(model.config)
    except SaffuError as err:
        row["hf"] = f"not exported: {err}"
    else:
        row.update(_hf(model, run, manager, harness))
    row["seconds"] = time.perf_counter() - tick
    print(f"{name}: saffu blimp {ours:.4f}, harness {harness:.4f}"
          + (f", harness on the export {row['harness_hf']:.4f}" if "harness_hf" in row else f" ({row['hf']})"),
          flush=True)
    return row


def _hf(model, run: Path, manager, harness: float) -> dict:
    """The harness's Hugging Face model on ``run``'s export: its accuracy and its difference from ``harness``."""
    import lm_eval

    from saffu.interop.hf import export_hf, model_card
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "export"
        export_hf(model.params, model.config, model.workdir.path / "tokenizer.json", out,
                  model_card(run, model.workdir, model.config, model.weights))
        hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},dtype=float32,device=cpu,batch_size=64",
                                     tasks=["saffu_blimp"], task_manager=manager, log_samples=False,
                                     verbosity="WARNING")["results"]["saffu_blimp"]["acc,none"]
    return {"harness_hf": hf, "hf_minus_saffu_harness_points": 100 * (hf - harness)}


def main(argv=None) -> int:
    args = script_options(Options, argv, __doc__.splitlines()[0])
    from saffu.interop.harness import write_blimp_tasks
    rows = []
    with tempfile.TemporaryDirectory() as tasks:
        write_blimp_tasks(args.blimp, tasks)
        for item in args.run:
            name, _, path = item.partition("=")
            if not path:
                raise SystemExit(f"--run takes NAME=RUN_FOLDER, not {item!r}")
            rows.append(score(name, Path(path), args.blimp, Path(tasks), args.harness_only))
    if args.write_result:
        command, date = " ".join(shlex.quote(a) for a in ["python", *sys.argv]), datetime.date.today().isoformat()
        rows = [{**row, "command": command, "date": date} for row in rows]
        if args.merge:              # the recorded rows, each with the command and date it came from
            scored = {row["name"] for row in rows}
            rows = [row for row in recorded(RESULT).get("rows", []) if row["name"] not in scored] + rows
        figures = {"blimp": str(args.blimp), "paradigms": len(list(args.blimp.glob("*.jsonl"))), "rows": rows}
        print(f"wrote {write_result(ROOT / 'results', 'harness_blimp', figures, seeds=[0])}")
    return 0


if __name__ == "__main__":
    script_main(main)
