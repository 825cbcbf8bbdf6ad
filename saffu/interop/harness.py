"""saffu models in lm-evaluation-harness, the evaluation BabyLM ranks models with
(``pip install -e ".[eval]"``).

Importing this module registers the harness model ``saffu`` (:class:`SaffuLM`), which serves
every model kind saffu trains (the transformer, SAFFU, the exact model, a residual, a
third-party model trained by saffu's trainer) from its run folder::

    import lm_eval
    import saffu.interop.harness
    lm_eval.simple_evaluate(model="saffu", model_args="run=runs/tf", tasks=["saffu_blimp"],
                            task_manager=lm_eval.tasks.TaskManager(include_path="tasks/"))

or from the command line, ``saffu harness --run runs/tf --blimp ../shared/data/blimp``
(:func:`evaluate`). :func:`write_blimp_tasks` writes task configs for a folder of BLiMP-format
``*.jsonl`` paradigm files (the harness's own ``blimp`` tasks download their data; these read
the local files): one task ``saffu_blimp_<paradigm>`` per file and the group ``saffu_blimp``,
whose accuracy is over all pairs, as ``saffu blimp`` reports it.

Scoring follows saffu's own: every context is read after an ``<eod>`` (a document start), so a
BLiMP sentence (empty context) gets the figure ``saffu blimp`` gives it
(:func:`saffu.eval.continuations.continuation_log_probs`). The tasks score the sentence alone
(``target_delimiter: ""``), as ``saffu blimp`` does, not with the leading space the harness's
own ``blimp`` tasks put in front of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import lm_eval.models  # noqa: F401  (the harness's own models: registering ours first would hide them)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from saffu._io import SaffuError
from saffu.data.tokenizer import EOD_ID, decode
from saffu.eval.blimp import load_blimp
from saffu.eval.continuations import continuation_log_probs, max_tokens
from saffu.eval.scoring import document_nll, generate_ids

#: Tokens ``generate_until`` adds when a request names no ``max_gen_toks``.
MAX_GEN_TOKS = 64


@register_model("saffu")
class SaffuLM(TemplateLM):
    """A saffu run as an lm-evaluation-harness model.

    Args:
      run: the run folder (of ``saffu train``, ``fit``, ``exact``, …).
      workdir: its work directory (default: the one its ``config.json`` records).
      checkpoint: ``"latest"`` (the last training checkpoint, else the explicit solution) or ``"explicit"``.
      step, words: the weights at a kept training step, or those kept when training first reached
        ``words`` words (``"5M"`` or an int; :func:`saffu.training.checkpoints.load_weights`).
      batch_size: rows per scoring call (default: about 2,048 positions per call).
      progress: show progress bars.
    """

    def __init__(self, run: str | Path, workdir: str | Path | None = None, checkpoint: str = "latest",
                 batch_size: int | str | None = None, progress: bool = True, step: int | str | None = None,
                 words: int | str | None = None, **unused) -> None:
        super().__init__()
        from saffu.data.workdir import open_workdir
        from saffu.training.checkpoints import check_inputs, load_weights, run_record
        self.run = Path(run)
        workdir = workdir if workdir is not None else run_record(self.run).get("workdir")
        if workdir is None:
            raise SaffuError(f"{run} records no work directory; pass workdir=")
        self.workdir = open_workdir(workdir)
        self.config = check_inputs(self.run, self.workdir)
        self.params, self.weights = load_weights(self.run, self.config, checkpoint,
                                                 None if step in (None, "") else int(step), words)
        self._serve(self.workdir, batch_size, progress)

    @classmethod
    def from_model(cls, model, params, workdir, weights: str = "given", batch_size: int | str | None = None,
                   progress: bool = True) -> SaffuLM:
        """A model saffu's trainer trained but did not build (a third-party model given to
        :func:`saffu.training.trainer.train`, e.g. after :func:`saffu.interop.explicit_init`) as a
        harness model: ``model`` brings its own ``logits`` and ``context``, ``params`` are its
        weights (a pytree), ``workdir`` the work directory (or its path) whose tokenizer it reads.
        ``weights`` labels where they came from (``self.weights``, as a run's says which checkpoint)."""
        from saffu.data.workdir import open_workdir
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        self.run, self.config, self.params, self.weights = None, model, params, weights
        self._serve(workdir if hasattr(workdir, "tokenizer") else open_workdir(workdir), batch_size, progress)
        return self

    def _serve(self, workdir, batch_size: int | str | None, progress: bool) -> None:
        self.workdir = workdir
        self.tokenizer = workdir.tokenizer()
        self.batch_size = None if batch_size in (None, "auto") else int(batch_size)
        self.progress = progress

    @property
    def eot_token_id(self) -> int:
        return EOD_ID

    @property
    def max_length(self) -> int:
        """Tokens of context and continuation one request reads (:func:`max_tokens`)."""
        return max_tokens(self.config)

    @property
    def tokenizer_name(self) -> str:
        return str(self.workdir.path / "tokenizer.json")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """BPE ids of ``string`` (no ``<eod>``: :meth:`_loglikelihood_tokens` puts one in front of every context)."""
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return decode(self.tokenizer, list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(log-probability, greedy)`` of each ``((context, continuation), context ids,
        continuation ids)``, every context read after an ``<eod>`` (a document start)."""
        pairs = [(ids if ids[:1] == [EOD_ID] else [EOD_ID, *ids], list(continuation))
                 for _, ids, continuation in requests]
        results = self._score(pairs, disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        log_probs, greedy = continuation_log_probs(self.params, self.config, pairs, self.batch_size,
                                                   self.progress and not disable_tqdm)
        return [(float(lp), bool(g)) for lp, g in zip(log_probs, greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability as a document, scored exactly as saffu's own evaluation
        scores a document of a split (:func:`saffu.eval.scoring.document_nll`): its tokens after
        an ``<eod>``, a long one in windows of ``eval_seq_len`` targets behind ``context`` of its
        own tokens, with the positions a split gives it (no closing ``<eod>``: a text ends where it ends)."""
        totals = -document_nll(self.params, self.config, [self.tok_encode(request.args[0]) for request in requests])
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), float(total))
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context (read after an ``<eod>``), cut at the first of its
        ``until`` strings, at most ``max_gen_toks`` tokens."""
        outputs = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tok_encode(context)[-(self.max_length - 1):]
            budget = int(options.get("max_gen_toks", MAX_GEN_TOKS))
            new = generate_ids(self.params, self.config, ids, jax.random.key(0), 1, budget, 1.0, 1)[0]
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, options), text)
            outputs.append(text)
        return outputs


def write_blimp_tasks(blimp: str | Path, out: str | Path) -> list[str]:
    """Write lm-evaluation-harness task configs for every ``*.jsonl`` paradigm file of ``blimp``
    into the folder ``out``: one multiple-choice task ``saffu_blimp_<paradigm>`` per file (the
    good sentence against the bad, scored alone) and the group ``saffu_blimp``, its accuracy the
    mean over all pairs. Returns the task names (the group last)."""
    blimp = Path(blimp).resolve()
    load_blimp(blimp)                                  # one clear error for a folder that is not BLiMP
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for path in sorted(blimp.glob("*.jsonl")):
        name = f"saffu_blimp_{path.stem}"
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"train": str(path)}},
                  "output_type": "multiple_choice", "test_split": "train", "doc_to_text": "",
                  "doc_to_target": 0, "doc_to_choice": "{{[sentence_good, sentence_bad]}}", "target_delimiter": "",
                  "num_fewshot": 0, "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                  "metadata": {"version": 1.0}}
        (out / f"{name}.yaml").write_text(json.dumps(config, indent=1) + "\n")     # JSON is YAML
        names.append(name)
    group = {"group": "saffu_blimp", "task": names, "metadata": {"version": 1.0},
             "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": True}]}
    (out / "saffu_blimp.yaml").write_text(json.dumps(group, indent=1) + "\n")
    return names + ["saffu_blimp"]


def evaluate(run: str | Path, tasks: list[str], include_path: list[str | Path] = (), workdir: str | Path | None = None,
             checkpoint: str = "latest", limit: int | None = None, batch_size: int | None = None,
             progress: bool = True, step: int | None = None, words: int | str | None = None) -> dict:
    """lm-evaluation-harness's ``simple_evaluate`` of ``run`` (:class:`SaffuLM`, its weights
    chosen by ``checkpoint`` / ``step`` / ``words``) on ``tasks``, with the task configs of
    ``include_path`` folders; returns the harness's results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    model = SaffuLM(run, workdir, checkpoint, batch_size, progress, step=step, words=words)
    manager = TaskManager(include_path=[str(p) for p in include_path] or None)
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, limit=limit,
                                   log_samples=False, verbosity="WARNING")
