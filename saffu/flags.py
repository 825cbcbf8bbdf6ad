"""Command-line flags generated from the config dataclasses of :mod:`saffu.configs`, so a
default lives only in the config and the help text only in its docstring.

* :func:`add_config_flags` adds ``--field-name`` for named fields of a config dataclass: the
  type from the field's annotation, the choices from :data:`saffu.configs.FIELD_CHOICES`, the
  default from the dataclass, the help from the class docstring's ``Attributes:`` section
  (Google style). A boolean becomes ``--field/--no-field``.
* :func:`config_from_args` builds the config back from the parsed flags.
* :func:`script_options` parses an experiment's command line into its options dataclass (the
  scripts under ``experiments/`` declare their options as data and parse nothing themselves).
* :class:`HelpFormatter` shows every option's default after its help.

It imports only :mod:`saffu.configs` and the standard library (``saffu --help`` loads no
array library).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

from saffu import configs
from saffu._io import SaffuError, read_settings


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default (taken from the configs) after its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is not None and default is not argparse.SUPPRESS and not isinstance(default, bool)
                and default != [] and action.option_strings and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """``{field: help}`` from the ``Attributes:`` section of ``cls``'s docstring: each
    ``name: text`` entry (``a, b: text`` documents both) with its indented continuation lines,
    its first sentence; reStructuredText markup (````x````, ``:mod:`x```) is reduced to its text."""
    lines = (cls.__doc__ or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return {}
    entries: dict[str, list[str]] = {}
    indent, current = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            if current is None:
                continue
            current = None            # a blank line ends the entry (later paragraphs are notes)
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        match = re.match(r"\s*([A-Za-z_][\w, ]*):\s(.*)", line) if depth == indent else None
        if match:
            current = [match.group(2).strip()]
            for name in match.group(1).split(","):
                entries[name.strip()] = current
        elif depth < indent:
            break
        elif current is not None and depth > indent:
            current.append(line.strip())
    clean = lambda text: re.sub(r":\w+:`~?([^`]*)`", r"\1", text).replace("``", "").replace("%", "%%")
    first = lambda text: re.split(r"(?<=\.)\s+(?=[A-Z0-9])", text)[0]     # the first sentence: the rest are notes
    return {name: clean(first(" ".join(words))).rstrip(".") for name, words in entries.items()}


def _field(cls: type, name: str) -> dataclasses.Field:
    try:
        return next(f for f in dataclasses.fields(cls) if f.name == name)
    except StopIteration:
        raise ValueError(f"{cls.__name__} has no field {name!r}") from None


def default_of(cls_or_config, name: str):
    """The default of field ``name``: the value of a config instance, else the dataclass's default."""
    if not isinstance(cls_or_config, type):
        return getattr(cls_or_config, name)
    field = _field(cls_or_config, name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def flag_name(name: str, rename: dict | None = None) -> str:
    """``--field-name`` of field ``name`` (or its ``rename``)."""
    return (rename or {}).get(name) or "--" + name.replace("_", "-")


def flags_of(settings: dict, rename: dict | None = None) -> list[str]:
    """``settings`` ``{name: value}`` as the words of a command line: ``--name value`` (a float
    as ``%g``), a boolean ``--name`` or ``--no-name``; ``{"block": "llama", "output_bias": False}``
    is ``--block llama --no-output-bias``."""
    words = []
    for name, value in settings.items():
        flag = flag_name(name, rename)
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return words


def dest_of(name: str, rename: dict | None = None) -> str:
    """The parsed attribute of field ``name``: the field name, or that of its renamed flag."""
    return flag_name(name, rename).lstrip("-").replace("-", "_") if name in (rename or {}) else name


def _scalar(annotation: str):
    return {"int": int, "float": float, "str": str, "Path": Path}.get(annotation)


def add_config_flags(parser, cls: type, fields, rename: dict | None = None, defaults=None,
                     help: dict | None = None, extra: dict | None = None):
    """Add a flag for each of ``fields`` of the config dataclass ``cls`` to ``parser`` (a parser
    or an argument group). ``rename`` maps a field to its flag (``{"heads": "--attention-heads"}``),
    ``defaults`` is a config instance whose values are the defaults (else the dataclass's),
    ``help`` replaces or formats the docstring's help (``{}`` in it is the docstring's text),
    ``extra`` gives further ``add_argument`` keywords of a field (``{"groups": {"type": f}}``: a
    type where the annotation is not a plain one). Returns ``parser``."""
    docs = field_help(cls)
    for name in fields:
        field = _field(cls, name)
        annotation = (field.type.__name__ if isinstance(field.type, type) else str(field.type)).replace(" ", "")
        default = default_of(defaults if defaults is not None else cls, name)
        text = docs.get(name, "")
        if help and name in help:
            text = help[name].format(text) if "{}" in help[name] else help[name]
        kwargs = {"default": default, "help": text}
        more = (extra or {}).get(name, {})
        scalar = _scalar(annotation.replace("|None", ""))
        if "type" in more:                      # the caller's parser of the whole value
            pass
        elif annotation == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif annotation.startswith("tuple[") and annotation.endswith(",...]"):
            kwargs.update(type=_scalar(annotation[len("tuple["):-len(",...]")]), nargs="*", default=list(default))
        elif scalar:
            kwargs["type"] = scalar
        else:
            raise ValueError(f"{cls.__name__}.{name} ({field.type}) needs a type in extra=")
        choices = configs.FIELD_CHOICES.get((cls, name))
        if choices:
            kwargs["choices"] = choices
        parser.add_argument(flag_name(name, rename), **{**kwargs, **more})
    return parser


def config_from_args(cls: type, args, fields, rename: dict | None = None, **overrides):
    """``cls(**{field: the parsed flag of each of fields}, **overrides)`` (lists become tuples)."""
    values = {}
    for name in fields:
        value = getattr(args, dest_of(name, rename))
        values[name] = tuple(value) if isinstance(value, list) else value
    return cls(**{**values, **overrides})


def script_options(cls: type, argv=None, description: str | None = None, check=None):
    """A script's command line (``argv``; default ``sys.argv[1:]``) parsed into ``cls``, its
    options dataclass: one flag per field, as :func:`add_config_flags` makes them (the type from
    the annotation, the help from the docstring's ``Attributes:``, the default from the field; a
    boolean is ``--field/--no-field``). A field's ``metadata`` gives further ``add_argument``
    keywords (``choices``, ``metavar``, ``required``, ``nargs``, ``action``; ``hidden``: a flag
    parsed but not listed, e.g. a child process's). ``--help`` prints the
    ``description`` (default: the docstring's first line) and every flag with its default.
    ``check(options)``: raises :class:`SaffuError` on options that do not go together, which
    becomes a usage error (its message, exit status 2) like an unknown flag's."""
    fields = dataclasses.fields(cls)
    parser = argparse.ArgumentParser(description=description or (cls.__doc__ or "").strip().splitlines()[0],
                                     formatter_class=HelpFormatter, allow_abbrev=False)
    extra = {f.name: {key: value for key, value in f.metadata.items() if key != "hidden"} for f in fields}
    for f in fields:            # an internal flag (a script's child processes): parsed, not listed
        if f.metadata.get("hidden"):
            extra[f.name]["help"] = argparse.SUPPRESS
    add_config_flags(parser, cls, [f.name for f in fields], extra=extra)
    options = config_from_args(cls, parser.parse_args(argv), [f.name for f in fields])
    try:
        if check is not None:
            check(options)
    except SaffuError as err:
        parser.error(str(err))
    return options


def script_main(main: Callable[[], object]) -> None:
    """Run a script's ``main()`` and exit: status 0, or ``main``'s when it returns an ``int``; a
    :class:`SaffuError` (bad input, a failed run, which the runner names with its log) ends it
    with its one line, ``SCRIPT: error: MESSAGE``, and status 1 instead of a traceback."""
    try:
        status = main()
    except SaffuError as err:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {err}")
    sys.exit(status if isinstance(status, int) else 0)


def exact_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """``"0 1 0,1"`` -> ``((0,), (1,), (0, 1))`` (argparse type of ``--groups``)."""
    try:
        return tuple(tuple(int(x) for x in group.split(",")) for group in text.split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--groups takes space-separated groups of comma-separated offsets, "
                                         f"e.g. \"0 1 0,1\"; got {text!r}") from None


DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "default_corpus"

# --- the flag groups commands share: each config's fields (and renamed flags) in one place -------

ARCH, ARCH_RENAME = ("radius", "heads", "positions", "hidden", "value_form", "blocks", "exact_positions", "chain",
                     "chain_share", "chain_blocks"), {"chain": "--chain-structure"}
OUTPUT, OUTPUT_RENAME = ("output", "output_share", "output_blocks", "guide_share"), {
    "output": "--output-structure", "guide_share": "--output-guided"}
TRANSFORMER = ("width", "layers", "heads", "mlp_ratio", "context_tokens", "max_len", "ffn", "ffn_share", "ffn_blocks",
               "guide_share", "output_bias", "block", "across_documents")
TRANSFORMER_RENAME = {"heads": "--attention-heads", "context_tokens": "--context", "guide_share": "--self-guided"}
#: A penzai model's flags: width, layers, heads and context are the transformer's flags.
PENZAI, PENZAI_RENAME = ("family", "width", "layers", "heads", "mlp", "tied", "context_tokens"), {
    "heads": "--attention-heads", "context_tokens": "--context", "mlp": "--mlp-width"}
TRAIN = ("steps", "batch_size", "seq_len", "learning_rate", "warmup_steps", "weight_decay", "adam_eps", "eval_every",
         "eval_windows", "checkpoint_every", "seed", "freeze", "thaw_step", "on_nonfinite", "log_every", "compute_dtype",
         "dropout", "words_unit", "tensorboard")
FACTOR = ("mu", "column_power", "oversample", "power_iterations", "seed", "refine_steps", "refine_offsets",
          "refine_learning_rate", "buckets", "holdout_tokens", "chunk_size")
EXACT = ("groups", "mu", "buckets", "bucket_by", "smoothing", "nested", "holdout_tokens", "chunk_size")
SMOOTHING, SMOOTHING_RENAME = ("kind", "mu", "alpha"), {"kind": "--smoothing"}
PREPARE = ("vocab_size", "allow_smaller_vocab", "strict")
DEVICE_CHECK = tuple(f.name for f in dataclasses.fields(configs.DeviceCheckConfig))
START = ("init", "model", "explicit_pieces", "explicit_embedding_rms", "explicit_output_rms", "explicit_tied", "residual",
         "bundle", "reference", "inherit_layers", "inherit_before_lazy", "start_from", "grow_by", "devices")
RESIDUAL_RENAME = {"scale": "--residual-scale", "folds": "--cross-fit"}
#: ``--model`` -> its config class, the fields its flags set and their renamed flags
MODEL = {"saffu": (configs.SaffuConfig, ("bits", *ARCH), ARCH_RENAME),
         "transformer": (configs.TransformerConfig, TRANSFORMER, TRANSFORMER_RENAME),
         "factorised": (configs.FactorisedConfig, ("rank", "positions", "radius", "heads", *OUTPUT), OUTPUT_RENAME),
         "penzai": (configs.PenzaiConfig, PENZAI, PENZAI_RENAME)}


def add_common(parser) -> None:
    parser.add_argument("--metrics-json", type=Path, help="write the figures as a flat JSON object here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or announcements")


def add_process_flags(parser) -> None:
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes (hosts) in a multi-process job, each with its own share of the documents "
                             "(statistics) or of every batch (training); without --coordinator, all of them are "
                             "started on this machine, one per core")
    parser.add_argument("--process-id", type=int, default=0, help="this process's index in [0, num-processes)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (jax.distributed); every process runs the "
                                              "same command with its own --process-id")


def add_eval_flags(parser) -> None:
    add_config_flags(parser, configs.EvalConfig, ("eval_tokens",))


def add_run_flags(parser, run_help: str = "run directory to create", run: bool = True) -> None:
    """``--workdir`` (and ``--run``): the inputs and the output of a command."""
    parser.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    if run:
        parser.add_argument("--run", type=Path, required=True, help=run_help)


def add_checkpoint_flags(parser) -> None:
    """``--workdir``, ``--run`` and the weights flags (:func:`add_weights_flags`) of a command that reads a run's weights."""
    add_run_flags(parser, "run directory (of `saffu fit` or `saffu train`)")
    add_weights_flags(parser)


def add_weights_flags(parser) -> None:
    """``--checkpoint``, ``--step`` and ``--words``: which of a run's weights a command reads
    (:func:`saffu.training.checkpoints.load_weights`)."""
    parser.add_argument("--checkpoint", choices=["latest", "explicit"], default="latest",
                        help="latest: the latest training checkpoint, or the explicit solution when there is none; "
                             "explicit: the explicit solution")
    parser.add_argument("--step", type=int, help="the weights at this training step (a kept checkpoint)")
    parser.add_argument("--words", help="the weights kept when training first reached this many words (1M, 2M, …; "
                                        "see RUN/words.json)")


def add_model_flags(parser, config, what: str, background: bool = True) -> None:
    """Code and smoothing flags with the defaults of ``config`` (a solver or bigram config);
    ``background``: also the codes' background blend (the bigram's; SAFFU's solver has none)."""
    add_config_flags(parser, configs.CipherConfig, ("bits", "background") if background else ("bits",),
                     help={"bits": "bit-cipher bits b (codes have b+1 dims)", "background": "background blend weight "
                                                                                            "λ in [0,1)"})
    add_config_flags(parser, configs.Smoothing, SMOOTHING, SMOOTHING_RENAME, defaults=config.smoothing,
                     help={"kind": f"smoothing of {what}", "mu": f"Dirichlet prior strength of {what}"})
    add_config_flags(parser, type(config), ("holdout_tokens", "chunk_size"), defaults=config)


def add_bigram_flags(parser) -> None:
    add_model_flags(parser, configs.BigramConfig(), "the bigram layer's P(next | code)")


def add_architecture_flags(parser) -> None:
    add_config_flags(parser, configs.SaffuConfig, ARCH, ARCH_RENAME)


def add_output_structure_flags(parser) -> None:
    add_config_flags(parser, configs.FactorisedConfig, OUTPUT, OUTPUT_RENAME, extra={"guide_share": {"metavar": "SHARE"}})


def add_transformer_flags(parser) -> None:
    add_config_flags(parser, configs.TransformerConfig, TRANSFORMER, TRANSFORMER_RENAME,
                     extra={"guide_share": {"metavar": "SHARE"}})


def smoothing_from_args(args) -> configs.Smoothing:
    """The :class:`saffu.configs.Smoothing` of ``--smoothing`` / ``--mu`` / ``--alpha``."""
    return config_from_args(configs.Smoothing, args, SMOOTHING, SMOOTHING_RENAME)


def bigram_from_args(args) -> configs.BigramConfig:
    """The :class:`saffu.configs.BigramConfig` of the code and smoothing flags (:func:`add_model_flags`)."""
    return configs.BigramConfig(cipher=configs.CipherConfig(bits=args.bits, background=args.background),
                                smoothing=smoothing_from_args(args), holdout_tokens=args.holdout_tokens,
                                chunk_size=args.chunk_size)


#: ``saffu train``'s flags outside the configs that change what a run learns (its spec's ``options``).
TRAIN_OPTIONS = ("holdout_tokens", "residual_scale", "anneal_share", "cross_fit")
#: Training fields a resumed run may change: when and how it reports and saves, and how long it trains.
RESUMABLE = frozenset({"steps", "eval_every", "eval_windows", "checkpoint_every", "log_every", "words_unit",
                       "tensorboard", "on_nonfinite", "devices"})


def train_spec(start, model, train, options: dict) -> dict:
    """A run's spec (``RUN/train.json``; ``saffu train --config`` reads it back): the sections
    ``start`` (:class:`~saffu.configs.StartConfig`), ``model`` (its kind and the fields its flags
    set), ``train`` (:class:`~saffu.configs.TrainConfig`) and ``options`` (:data:`TRAIN_OPTIONS`)."""
    kind = getattr(model, "kind", None)
    fields = MODEL.get(kind, (None, ()))[1]
    return {"start": dataclasses.asdict(start), "model": {"kind": kind, **{f: getattr(model, f) for f in fields}},
            "train": dataclasses.asdict(train), "options": dict(options)}


def spec_defaults(path: Path) -> dict:
    """``saffu train``'s parsed defaults from a spec file (JSON, or TOML with the same sections:
    :func:`train_spec`, and ``eval`` for ``eval_tokens``): every value becomes its flag's
    default, so flags given on the command line override it. A spec ``saffu train`` wrote (it
    records its ``command``) whose model lacks a field whose default changed since gets the value
    it ran with (:data:`saffu.configs.SAVED_BEFORE`). One error line for a file that is not a spec."""
    path = Path(path)
    spec = read_settings(path, f"--config {path} is not a readable run spec")
    unknown = set(spec) - {"start", "model", "train", "options", "eval", "command"}
    if unknown:
        raise SaffuError(f"--config {path}: unknown sections {sorted(unknown)} (start, model, train, options, eval)")
    defaults = {}

    def take(section: str, allowed, cls=None, rename=None, skip=()):
        for name, value in spec.get(section, {}).items():
            if name in skip:
                continue
            if name in allowed:
                defaults[dest_of(name, rename)] = list(value) if isinstance(value, (list, tuple)) else value
            elif cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
                raise SaffuError(f"--config {path}: {section}.{name} is not a setting of saffu train")
            elif value != getattr(cls, name):
                raise SaffuError(f"--config {path}: {section}.{name} = {value!r} has no flag (only its default, "
                                 f"{getattr(cls, name)!r})")

    take("start", (*START, "ffn_from"), configs.StartConfig)
    take("train", TRAIN, configs.TrainConfig)
    take("options", TRAIN_OPTIONS)
    take("eval", ("eval_tokens",), configs.EvalConfig)
    kind = spec.get("model", {}).get("kind") or spec.get("start", {}).get("model")
    model = MODEL.get(kind)
    if spec.get("model") and model is None:
        raise SaffuError(f"--config {path}: model.kind must be one of {', '.join(MODEL)}, not {kind!r}")
    if model is not None:
        cls, fields, rename = model
        take("model", fields, cls, rename, skip=("kind", "vocab_size"))
        defaults["model"] = kind
        if "command" in spec:           # saffu train wrote it: a field it lacks has its value from before
            defaults.update({dest_of(name, rename): value for name, value in configs.SAVED_BEFORE.get(kind, {}).items()
                             if name in fields and name not in spec.get("model", {})})
    return defaults


def model_from_args(model: str, args, vocab_size: int):
    """The config of a new ``model`` (``saffu``, ``transformer``, ``factorised``, ``penzai``) from its flags."""
    cls, fields, rename = MODEL[model]
    return config_from_args(cls, args, fields, rename, vocab_size=vocab_size)


# --- each command's flags ---------------------------------------------------------------------

def _prepare_flags(p) -> None:
    """corpus -> tokenizer + memory-mapped token streams

    Train a byte-level BPE on the training split, re-rank ids by frequency and write every split's token
    stream to the work directory."""
    p.add_argument("--corpus", type=Path, help="BabyLM-layout folder (train_10M/, dev/, ...)")
    p.add_argument("--train-files", nargs="+", help="plain-text training files instead of --corpus")
    p.add_argument("--dev-files", nargs="+", help="plain-text dev files (with --train-files)")
    p.add_argument("--workdir", type=Path, required=True, help="work directory to create")
    p.add_argument("--train-split",
                   help="the split to train on: train_10M or train_100M of a BabyLM folder (default: train_10M; "
                        "with --train-files the split is called train)")
    add_config_flags(p, configs.PrepareConfig, PREPARE, help={"strict": f"refuse a split that is mostly not text (more "
                     f"than {100 * configs.PrepareConfig.max_replaced_share:.0f}%% invalid UTF-8) instead of warning"})
    p.add_argument("--corpus-name", help="label for reports (default: the folder name), "
                                         "e.g. babylm-2023-4src for ../shared/data/babylm/2023")


def _stats_flags(p) -> None:
    """streaming statistics + explicit bigram or unigram + dev figures

    Stream the training split through the accumulators, solve the explicit model and score every other
    split."""
    add_process_flags(p)
    add_bigram_flags(p)
    add_run_flags(p, run=False)
    p.add_argument("--model", choices=["bigram", "unigram"], default="bigram")
    p.add_argument("--radius", type=int, default=1,
                   help="also compute and save offset statistics F_δ, δ < radius, to statistics.npz")
    p.add_argument("--save-statistics", action="store_true", help="save statistics.npz even for radius 1")


def _fit_flags(p) -> None:
    """explicit SAFFU solution -> run directory (no backprop)

    Solve a SAFFU model stage by stage from streaming statistics, save it to --run and score every
    non-training split (about --eval-tokens tokens each)."""
    add_run_flags(p)
    add_architecture_flags(p)
    add_eval_flags(p)
    add_model_flags(p, configs.SolverConfig(), "every SAFFU stage's conditional distributions", background=False)


def _factorise_flags(p) -> None:
    """explicit low-rank factors -> factorised-model run directory (no backprop)

    Count the exact offset groups, factorise their stacked log-likelihood-ratio matrices with one
    matrix-free randomized SVD (per-offset embeddings E_p, one output factor B), refine them with a few likelihood
    steps against the offsets' smoothed conditionals, calibrate temperatures per offset and count bucket on
    held-out training documents, save to --run (`saffu train --init explicit --run R` warm-starts from it)
    and score every non-training split."""
    add_run_flags(p)
    add_eval_flags(p)
    add_config_flags(p, configs.FactorisedConfig, ("rank", "positions", "radius", "heads"))
    add_output_structure_flags(p)
    add_config_flags(p, configs.FactorConfig, FACTOR, help={
        "oversample": "extra directions {}", "power_iterations": "subspace iterations {}", "seed": "seed {}"})


def _exact_flags(p) -> None:
    """explicit token-resolution model -> run directory (no backprop)

    Count exact-token context groups (offsets and conjunctions), solve their log-likelihood-ratio tables
    with temperatures per group and context-count bucket on held-out training documents, save to --run and
    score every non-training split."""
    add_run_flags(p)
    add_process_flags(p)
    add_eval_flags(p)
    add_config_flags(p, configs.ExactConfig, EXACT, extra={"groups": {"type": exact_groups}}, help={
        "groups": 'context offsets per group, space-separated, e.g. "0 1 2 3 0,1 0,1,2" (0 = the previous token; '
                  '"0,1" = the previous two tokens together)'})


def _train_flags(p) -> None:
    """backprop with optax from explicit (warm) or random (cold) init

    Train a SAFFU model (or the transformer baseline, or a penzai model); a rerun resumes from --run's last
    checkpoint. Ends with an evaluation of about --eval-tokens tokens per split."""
    add_run_flags(p, "run directory (of `saffu fit` for --init explicit)")
    add_process_flags(p)
    add_config_flags(p, configs.StartConfig, START, extra={
        "init": {"required": True, "default": None}, "explicit_pieces": {"nargs": "*"},
        "residual": {"type": Path, "metavar": "EXACT_RUN"}, **{f: {"type": Path, "metavar": "RUN"} for f in
                                                              ("reference", "start_from")}})
    add_config_flags(p, configs.FactorConfig, ("holdout_tokens",),
                           help={"holdout_tokens": "transformer --init explicit: {}"})
    add_config_flags(p, configs.ResidualConfig, ("scale", "anneal_share", "folds"), RESIDUAL_RENAME,
                           extra={"folds": {"metavar": "K"}}, help={"folds": "with --residual: cross-fit over K ≥ 2 "
                           "folds of whole documents: each training step's windows come from one fold and its explicit "
                           "part is the exact model solved without that fold (solved into RUN/folds); evaluation uses "
                           "the exact model of the whole split (0: off)"})
    add_config_flags(p, configs.FactorisedConfig, ("rank",))
    add_output_structure_flags(p)
    add_architecture_flags(p)
    t = p.add_argument_group("transformer (with --model transformer)")
    add_transformer_flags(t)
    add_config_flags(t, configs.StartConfig, ("ffn_from",), extra={"ffn_from": {"type": Path, "metavar": "RUN"}})
    z = p.add_argument_group("penzai (with --model penzai, pip install -e '.[models]'; --width, --layers, "
                             "--attention-heads and --context as the transformer's)")
    add_config_flags(z, configs.PenzaiConfig, ("family", "mlp", "tied"), PENZAI_RENAME)
    add_config_flags(p, configs.SaffuConfig, ("bits",))
    add_config_flags(p, configs.TrainConfig, TRAIN)
    add_eval_flags(p)
    p.add_argument("--config", type=Path, metavar="SPEC",
                   help="a run spec (another run's RUN/train.json, or TOML with its sections start, model, train, "
                        "options): its values become the flags' defaults, flags given here override them, each "
                        "also by its dotted name (--train.learning_rate 3e-3, --model.width 256)")


def _eval_flags(p) -> None:
    """loss, perplexity, bits per byte of a run

    Score a run's weights on every non-training split (or --split): loss in nats/token, perplexity, bits per
    byte and per-word perplexity."""
    add_checkpoint_flags(p)
    p.add_argument("--split", nargs="*", help="splits to score (default: all but training)")
    add_eval_flags(p)


def _pack_flags(p) -> None:
    """make a run self-contained (a residual's exact model copied in)

    Copy the exact model a residual run was trained over into the run (RUN/exact; its content fingerprint
    checked first) and point the run at the copy, so the run survives moving it and re-solving or deleting
    the exact run."""
    p.add_argument("--run", type=Path, required=True, help="a residual run directory (of `saffu train --residual`)")


def _init_weights_flags(p) -> None:
    """the explicit pieces as a framework-free safetensors init file, or a Hugging Face checkpoint

    Solve the explicit pieces of rank --rank from the work directory's training split and write them
    (log-unigram bias, embeddings, output kernel, their RMS, the unigram counts) to a safetensors file with a
    JSON manifest beside it, for any framework to load; with --hf-config, as the weights of a GPT-2 or Llama
    checkpoint that transformers loads and trains (experiments/hf_explicit_init.py)."""
    add_run_flags(p, run=False)
    p.add_argument("--rank", type=int, required=True, help="width d of the model the pieces initialise")
    p.add_argument("--out", type=Path, required=True, help="the init file (NAME.safetensors; NAME.json beside it), "
                                                           "or with --hf-config the checkpoint folder")
    add_config_flags(p, configs.FactorConfig, ("holdout_tokens",))
    p.add_argument("--hf-config", choices=["gpt2", "llama"],
                   help="write a Hugging Face checkpoint of this architecture (width --rank) instead: the explicit "
                        "embeddings and output kernel, the rest random (neither has an output bias, so the "
                        "log-unigram is not carried), with the tokenizer")
    p.add_argument("--layers", type=int, default=configs.TransformerConfig.layers, help="--hf-config: layers")
    p.add_argument("--attention-heads", type=int, default=configs.TransformerConfig.heads,
                   help="--hf-config: attention heads")
    p.add_argument("--max-len", type=int, default=configs.TransformerConfig.max_len, help="--hf-config: positions")
    p.add_argument("--seed", type=int, default=0, help="--hf-config: seed of the random weights")
    p.add_argument("--random", action="store_true",
                   help="--hf-config: every weight random, the same draw as the explicit checkpoint's rest (the control)")


def _export_flags(p) -> None:
    """a trained transformer run as a Hugging Face checkpoint (GPT-2 or Llama)

    Write a transformer run without an output bias (the default) as config.json, model.safetensors, the
    tokenizer files and a model card (README.md) of a checkpoint that transformers loads:
    GPT2LMHeadModel for the gpt block, LlamaForCausalLM for the llama block. --step or --words picks
    an earlier checkpoint."""
    add_checkpoint_flags(p)
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")


def _blimp_flags(p) -> None:
    """BLiMP minimal-pair accuracy of a run

    Score every BLiMP pair (good sentence above bad, ties wrong) with a run's weights: accuracy overall, per
    field and per paradigm."""
    add_checkpoint_flags(p)
    p.add_argument("--blimp", type=Path, required=True, help="folder of BLiMP paradigm *.jsonl files")


def _harness_flags(p) -> None:
    """lm-evaluation-harness tasks of a run (pip install -e ".[eval]")

    Score a run with lm-evaluation-harness (the model `saffu`, saffu.interop.harness): the tasks of --tasks,
    the task configs of --include-path folders, and with --blimp a local BLiMP folder as the group
    saffu_blimp (one task per paradigm file; accuracy over all pairs, as `saffu blimp` reports it)."""
    p.add_argument("--run", type=Path, required=True, help="run directory (of `saffu fit`, `train`, `exact`, …)")
    p.add_argument("--workdir", type=Path, help="its work directory (default: the one the run records)")
    add_weights_flags(p)
    p.add_argument("--tasks", nargs="+", default=[], help="harness task or group names")
    p.add_argument("--blimp", type=Path, help="folder of BLiMP paradigm *.jsonl files, scored as the group saffu_blimp")
    p.add_argument("--include-path", type=Path, action="append", default=[],
                   help="a folder of task configs (repeatable), as lm_eval's --include_path")
    p.add_argument("--write-tasks", type=Path, help="keep --blimp's task configs in this folder (for lm_eval itself)")
    p.add_argument("--limit", type=int, help="at most this many documents per task (a quick check)")
    p.add_argument("--batch-size", type=int, help="rows per scoring call (default: about 2,048 positions)")


def _sweep_flags(p) -> None:
    """a grid of saffu train runs, one process per core (saffu.runner)

    Run every combination of a grid file's axes over its base spec (TOML or JSON: base = the
    sections of a saffu train --config spec; axes = {"section.setting" = [values]}), each a saffu
    train run in OUT/NAME (NAME: its axes' values). A finished run is skipped, an interrupted one
    resumes; a folder holding another spec is refused. Prints and writes (OUT/rows.json) a row per run."""
    p.add_argument("grid", type=Path, help="the grid file (TOML or JSON)")
    p.add_argument("--workdir", type=Path, required=True, help="work directory of `saffu prepare`")
    p.add_argument("--out", type=Path, required=True, help="folder of the run folders")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, each pinned to a core of its own")


def _ngram_flags(p) -> None:
    """Kneser-Ney n-gram baseline from the engine's counts (+ ARPA, BLiMP)

    Count n-grams of the training split (documents never crossed), estimate interpolated modified
    Kneser-Ney, score every other split, optionally write the ARPA file (kenlm loads it) and score BLiMP."""
    add_run_flags(p, run=False)
    add_config_flags(p, configs.NgramConfig, ("order",))
    p.add_argument("--arpa", type=Path, help="write the model as an ARPA file here")
    p.add_argument("--blimp", type=Path, help="folder of BLiMP paradigm *.jsonl files")


def _generate_flags(p) -> None:
    """sample documents from a run, or continuations of --prompt

    Sample documents from a run's weights, each from a document start (followed by --prompt's tokens) to
    its <eod> or --max-tokens new tokens."""
    add_checkpoint_flags(p)
    add_config_flags(p, configs.GenerateConfig, ("num_samples", "max_tokens", "temperature", "top_k", "seed", "prompt"))


def _inspect_flags(p) -> None:
    """attention diagnostics of a run: effective ranks, lazy layers

    Average every layer's and head's post-softmax attention over evenly spaced windows of a split, then
    report its effective rank (the smallest r whose top-r singular values hold --energy of the squared
    total), its largest column's share of the mass, each layer's maximum rank over heads and whether the
    layer is lazy (maximum rank ≤ --lazy-rank). Writes JSON and a per-layer plot."""
    add_checkpoint_flags(p)
    add_config_flags(p, configs.InspectConfig, ("split", "windows", "seq_len", "energy", "lazy_rank"))
    p.add_argument("--out", type=Path, help="path stem of the JSON and PNG (default: RUN/attention)")


def _download_flags(p) -> None:
    """download the official BabyLM release (needs internet)

    Fetch the BabyLM release zip and lay it out as <dest>/train_10M, dev, test, train_100M."""
    p.add_argument("--dest", type=Path, required=True, help="new folder for the corpus")
    p.add_argument("--url", default=configs.BABYLM_2023_URL, help="release archive (any URL, file:// included)")
    p.add_argument("--sha256", help="expected checksum of the archive")


def _demo_flags(p) -> None:
    """the main job on the embedded corpus: explicit init, warm start, evaluation

    Prepare the embedded corpus, solve the explicit bigram and an explicit SAFFU model, run a short AdamW
    warm start from it and score dev after each stage. A rerun starts afresh."""
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="BabyLM-layout folder")
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="folder for everything the demo writes")
    add_config_flags(p, configs.DemoConfig, ("vocab_size",))
    add_config_flags(p, configs.SaffuConfig, ("radius",))
    p.add_argument("--saffu-mu", type=float, default=configs.SolverConfig.smoothing.mu,
                   help="Dirichlet strength of the SAFFU solver")
    add_config_flags(p, configs.DemoConfig, ("steps",))
    add_config_flags(p, configs.TrainConfig, ("learning_rate",))
    add_bigram_flags(p)
    p.set_defaults(bits=configs.DemoConfig.bits)


def _device_check_flags(p) -> None:
    """throughput and agreement of statistics, solve and training on this backend (CPU, GPU, TPU)

    Time the statistics pass at each chunk size (exact counts must not depend on it), the explicit
    SAFFU solve and warm-start training in float32 and bfloat16; with --reference (the
    device_check.json of the same check, usually a CPU's) check counts bit for bit and losses within
    tolerances, one PASS/FAIL line per item. Writes OUT/device_check.json; the exit status is 2 if
    any item fails. See docs/reliability.md."""
    p.add_argument("--workdir", type=Path, required=True, help="prepared work directory")
    p.add_argument("--out", type=Path, default=Path("runs/device_check"), help="output folder")
    add_config_flags(p, configs.DeviceCheckConfig, DEVICE_CHECK)


COMMAND_FLAGS = {"prepare": _prepare_flags, "stats": _stats_flags, "fit": _fit_flags, "factorise": _factorise_flags,
                 "exact": _exact_flags, "train": _train_flags, "eval": _eval_flags, "pack": _pack_flags,
                 "init-weights": _init_weights_flags, "export": _export_flags, "blimp": _blimp_flags,
                 "harness": _harness_flags, "sweep": _sweep_flags, "ngram": _ngram_flags, "generate": _generate_flags,
                 "inspect": _inspect_flags, "download": _download_flags, "demo": _demo_flags,
                 "device-check": _device_check_flags}

#: What each writing command writes into: ``(flag, attribute, a directory?)``; the command
#: holds that directory's write lock (an ARPA file: its folder's) for the whole run.
OUTPUTS = {"prepare": ("--workdir", "workdir", True), "stats": ("--workdir", "workdir", True),
           "fit": ("--run", "run", True), "exact": ("--run", "run", True), "factorise": ("--run", "run", True),
           "train": ("--run", "run", True), "pack": ("--run", "run", True), "demo": ("--workdir", "workdir", True),
           "ngram": ("--arpa", "arpa", False), "init-weights": ("--out", "out", False)}   # export: moved into place


def build_parser(commands: dict) -> argparse.ArgumentParser:
    """The ``saffu`` parser (building it imports nothing heavy): one sub-command per entry of
    ``commands`` (name -> the function that runs it) with the flags of :data:`COMMAND_FLAGS`
    (whose docstrings are the commands' help: the first paragraph is the one-line help, the rest
    the description) and ``--metrics-json`` / ``--quiet``."""
    parser = argparse.ArgumentParser(prog="saffu", description="Explicit (closed-form) SAFFU language models.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}
    for name, run_command in commands.items():
        help, _, description = inspect.cleandoc(COMMAND_FLAGS[name].__doc__).partition("\n\n")
        p = sub.add_parser(name, help=help, description=" ".join(description.split()), formatter_class=HelpFormatter)
        p.set_defaults(run_command=run_command)
        COMMAND_FLAGS[name](p)
        add_common(p)
        parser.commands[name] = p
    return parser


def dotted_flag(setting: str, kind: str) -> str:
    """The ``saffu train`` flag of a run spec's ``section.setting`` (``train.learning_rate`` ->
    ``--learning-rate``, ``model.heads`` of a transformer -> ``--attention-heads``), the model's
    settings those of model ``kind``; one error line for a setting ``saffu train`` does not have."""
    section, _, name = setting.partition(".")
    fields, rename = {"start": ((*START, "ffn_from"), None), "train": (TRAIN, None), "options": (TRAIN_OPTIONS, None),
                      "eval": (("eval_tokens",), None), "model": MODEL.get(kind, (None, (), None))[1:]}.get(
        section, ((), None))
    if name not in fields:
        raise SaffuError(f"--{setting} is not a setting of saffu train: write --SECTION.SETTING, SECTION one of "
                         f"start, model, train, options, eval (a run spec's sections)")
    return flag_name(name, rename)


def _dotted(words: list[str], kind: str) -> list[str]:
    """``saffu train``'s arguments with every ``--section.setting`` (or ``--section.setting=VALUE``)
    written as its flag (:func:`dotted_flag`)."""
    out = []
    for word in words:
        flag, equals, value = word.partition("=")
        if flag.startswith("--") and "." in flag and not flag[2:3].isdigit():
            word = dotted_flag(flag[2:], kind) + equals + value
        out.append(word)
    return out


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``; a ``saffu train --config SPEC`` is parsed again with the spec's
    values as the defaults (:func:`spec_defaults`), so the flags given override them, and its
    settings may be given by their dotted names (``--train.learning_rate 3e-3``, :func:`dotted_flag`)."""
    import sys
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["train"]:
        early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        early.add_argument("--config", type=Path)
        early.add_argument("--model", "--start.model", dest="model")
        known = early.parse_known_args(words[1:])[0]
        defaults = spec_defaults(known.config) if known.config is not None else {}
        if known.config is not None:
            train = parser.commands["train"]
            for action in train._actions:
                if action.dest in defaults:
                    action.required = False
            train.set_defaults(**defaults)
        kind = known.model or defaults.get("model") or configs.StartConfig.model
        argv = ["train", *_dotted(words[1:], kind)]
    return parser.parse_args(argv)
