"""Flags generated from the config dataclasses: the default is the dataclass's, the help its
docstring's, a bad value one error line, and the parsed flags build the config back."""

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from saffu import configs
from saffu._io import SaffuError
from saffu.flags import HelpFormatter, add_config_flags, config_from_args, field_help, script_options


@dataclasses.dataclass(frozen=True)
class Example:
    """A config for the test.

    Attributes:
      rate: the step size. Notes after the first sentence stay out of the help.
      kind: how it is ``done`` (see :mod:`saffu.flags`),
        over two lines.
      sizes, edges: shared text
        of two fields.
      verbose: say more.
      quiet: say less.
      limit: at most this many (None: no limit).
    """

    rate: float = 0.25
    kind: str = "plain"
    sizes: tuple[int, ...] = (1, 2)
    edges: tuple[int, ...] = ()
    verbose: bool = False
    quiet: bool = True
    limit: int | None = None


FIELDS = ("rate", "kind", "sizes", "edges", "verbose", "quiet", "limit")


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prog", formatter_class=HelpFormatter)
    return add_config_flags(parser, Example, FIELDS, **kwargs)


def test_help_comes_from_the_docstring():
    docs = field_help(Example)
    assert docs["rate"] == "the step size"                    # the first sentence, no trailing period
    assert docs["kind"] == "how it is done (see saffu.flags), over two lines"
    assert docs["sizes"] == docs["edges"] == "shared text of two fields"
    help_text = " ".join(_parser().format_help().split())
    assert "the step size (default: 0.25)" in help_text and "Notes after" not in help_text
    assert "--verbose, --no-verbose" in help_text


def test_defaults_types_and_booleans_come_from_the_dataclass():
    args = _parser().parse_args([])
    assert config_from_args(Example, args, FIELDS) == Example()
    args = _parser().parse_args(["--rate", "0.5", "--sizes", "3", "4", "--verbose", "--no-quiet", "--limit", "7"])
    config = config_from_args(Example, args, FIELDS, kind="fancy")
    assert config == Example(rate=0.5, kind="fancy", sizes=(3, 4), verbose=True, quiet=False, limit=7)


def test_rename_choices_defaults_and_help_overrides():
    parser = _parser(rename={"rate": "--learning-rate"}, defaults=Example(rate=0.125),
                     help={"kind": "the kind: {}"}, extra={"limit": {"metavar": "N"}})
    args = parser.parse_args([])
    assert args.learning_rate == 0.125 and not hasattr(args, "rate")
    assert config_from_args(Example, args, FIELDS, rename={"rate": "--learning-rate"}).rate == 0.125
    help_text = " ".join(parser.format_help().split())
    assert "the kind: how it is done" in help_text and "--limit N" in help_text


def test_every_config_flag_default_is_the_configs():
    from saffu.cli import build_parser
    parse = lambda *argv: vars(build_parser().parse_args(argv))
    train = parse("train", "--workdir", "w", "--run", "r", "--init", "random")
    assert train["eval_tokens"] == configs.EvalConfig.eval_tokens
    assert train["self_guided"] == configs.TransformerConfig.guide_share and train["output_bias"] is False
    assert train["block"] == configs.TransformerConfig.block == "llama"
    assert train["cross_fit"] == configs.ResidualConfig.folds and train["residual_scale"] == "fixed"
    generate = parse("generate", "--workdir", "w", "--run", "r")
    assert {k: generate[k] for k in ("num_samples", "max_tokens", "temperature", "top_k", "seed", "prompt")} == \
        dataclasses.asdict(configs.GenerateConfig())
    inspect = parse("inspect", "--workdir", "w", "--run", "r")
    assert (inspect["windows"], inspect["energy"]) == (configs.InspectConfig.windows, configs.InspectConfig.energy)
    assert parse("ngram", "--workdir", "w")["order"] == configs.NgramConfig.order
    assert parse("exact", "--workdir", "w", "--run", "r", "--groups", "0 0,1")["groups"] == ((0,), (0, 1))
    assert parse("demo")["bits"] == configs.DemoConfig.bits


def test_the_configs_choices_are_the_flags_choices():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, configs.TrainConfig, ("on_nonfinite", "compute_dtype"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--compute-dtype", "float16"])


@pytest.mark.parametrize("argv", [["generate", "--workdir", "w", "--run", "r", "--top-k", "many"],
                                  ["train", "--workdir", "w", "--run", "r", "--init", "random",
                                   "--compute-dtype", "float16"],
                                  ["ngram", "--workdir", "w", "--order", "12"]])
def test_a_bad_value_is_one_error_line(argv, tmp_path):
    if argv[0] == "ngram":                       # a value the config refuses (after parsing)
        argv = [*argv[:2], str(tmp_path), *argv[3:]]
    done = subprocess.run([sys.executable, "-m", "saffu", *argv], capture_output=True, text=True)
    assert done.returncode == 2
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and error[0].startswith(("saffu: error:", f"saffu {argv[0]}: error:"))
    assert done.stderr.strip().splitlines()[-1] == error[0]


def test_a_run_specs_dotted_settings_are_saffu_trains_flags():
    from saffu._io import SaffuError
    from saffu.flags import dotted_flag
    assert dotted_flag("train.learning_rate", "transformer") == "--learning-rate"
    assert dotted_flag("model.heads", "transformer") == "--attention-heads"      # the transformer's renamed flag
    assert dotted_flag("model.heads", "saffu") == "--heads"
    assert dotted_flag("model.context_tokens", "transformer") == "--context"
    assert dotted_flag("options.cross_fit", "transformer") == "--cross-fit"
    assert dotted_flag("start.explicit_embedding_rms", "transformer") == "--explicit-embedding-rms"
    for bad in ("train.nope", "optim.learning_rate", "model.width"):              # saffu has no width
        with pytest.raises(SaffuError, match="not a setting of saffu train"):
            dotted_flag(bad, "saffu")


def test_saffu_train_takes_dotted_overrides_over_a_spec(tmp_path, capsys):
    from saffu.cli import build_parser, main
    from saffu.flags import parse
    spec = tmp_path / "run.toml"
    spec.write_text('[start]\ninit = "random"\nmodel = "transformer"\n[model]\nwidth = 64\n[train]\n'
                    'learning_rate = 0.01\nsteps = 10\n')
    args = parse(build_parser(), ["train", "--workdir", "w", "--run", "r", "--config", str(spec),
                                  "--train.learning_rate", "0.02", "--model.width=32", "--model.heads", "2"])
    assert (args.learning_rate, args.width, args.attention_heads, args.steps, args.init) == (0.02, 32, 2, 10, "random")
    flat = parse(build_parser(), ["train", "--workdir", "w", "--run", "r", "--init", "random", "--start.model",
                                  "transformer", "--model.layers", "3"])
    assert (flat.model, flat.layers) == ("transformer", 3)
    assert main(["train", "--workdir", "w", "--run", "r", "--init", "random", "--train.nope", "1"]) == 2
    assert "--train.nope is not a setting of saffu train" in capsys.readouterr().err


def test_a_spec_saffu_wrote_keeps_the_model_it_ran(tmp_path):
    """A ``train.json`` written before the llama block and the mask across documents were the
    defaults names neither: read back, it is the gpt block with an output bias, document-local.
    A hand-written spec naming the same fields gets today's defaults."""
    from saffu.cli import build_parser
    from saffu.flags import parse
    old = {"command": "saffu train --model transformer", "start": {"init": "random", "model": "transformer"},
           "model": {"kind": "transformer", "width": 64, "layers": 2}, "train": {"steps": 10}}
    (tmp_path / "train.json").write_text(json.dumps(old))
    (tmp_path / "mine.json").write_text(json.dumps({key: value for key, value in old.items() if key != "command"}))
    read = lambda name: parse(build_parser(), ["train", "--workdir", "w", "--run", "r", "--config",
                                               str(tmp_path / name)])
    args = read("train.json")
    assert (args.width, args.block, args.output_bias, args.across_documents) == (64, "gpt", True, False)
    args = read("mine.json")
    assert (args.width, args.block, args.output_bias, args.across_documents) == (64, "llama", False, True)
    old["model"]["across_documents"] = True                    # a field it names is its own
    (tmp_path / "train.json").write_text(json.dumps(old))
    assert (read("train.json").across_documents, read("train.json").block) == (True, "gpt")


@dataclasses.dataclass
class _ScriptOptions:
    """A script's options.

    Attributes:
      out: where it writes
      epochs: the budgets
      mode: what to run
      write: write the results file
      child: a child process's part
    """

    out: Path = Path("runs/x")
    epochs: tuple[float, ...] = (1.0, 4.0)
    mode: str | None = dataclasses.field(default=None, metadata={"choices": ("grid", "budgets")})
    write: bool = True
    child: str | None = dataclasses.field(default=None, metadata={"hidden": True})


def _at_least_one_epoch(options: _ScriptOptions) -> None:
    if min(options.epochs) < 1:
        raise SaffuError(f"--epochs must be at least 1, got {min(options.epochs):g}")


def test_script_options_parse_a_dataclass_and_refuse_what_does_not_go_together(capsys):

    assert script_options(_ScriptOptions, []) == _ScriptOptions()
    options = script_options(_ScriptOptions, ["--out", "a", "--epochs", "2", "8", "--mode", "grid", "--no-write",
                                              "--child", "x"])
    assert options == _ScriptOptions(Path("a"), (2.0, 8.0), "grid", False, "x")
    with pytest.raises(SystemExit) as exit_:
        script_options(_ScriptOptions, ["--epochs", "0.5"], check=_at_least_one_epoch)
    assert exit_.value.code == 2 and "--epochs must be at least 1, got 0.5" in capsys.readouterr().err
    for wrong in (["--mode", "other"], ["--ou", "a"]):          # a choice outside the list; no abbreviations
        with pytest.raises(SystemExit):
            script_options(_ScriptOptions, wrong)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        script_options(_ScriptOptions, ["--help"])
    shown = capsys.readouterr().out
    assert "where it writes" in shown and "--no-write" in shown and "--child" not in shown   # hidden: parsed, not listed


def test_a_script_exits_with_its_status_and_a_saffu_error_as_one_line(monkeypatch):
    from saffu.flags import script_main
    monkeypatch.setattr("sys.argv", ["experiments/tune.py"])
    for returned, status in ((None, 0), (3, 3), ({"figures": 1}, 0)):       # a dict (a benchmark's figures): 0
        with pytest.raises(SystemExit) as exit_:
            script_main(lambda returned=returned: returned)
        assert exit_.value.code == status

    def fails():
        raise SaffuError("2 of 4 runs failed: a, b")
    with pytest.raises(SystemExit) as exit_:
        script_main(fails)
    assert exit_.value.code == "tune.py: error: 2 of 4 runs failed: a, b"      # printed to stderr, status 1


def test_settings_are_written_as_the_flags_that_set_them():
    from saffu.flags import TRANSFORMER_RENAME, flags_of
    assert flags_of({"block": "llama", "output_bias": False, "heads": 4}, TRANSFORMER_RENAME) == [
        "--block", "llama", "--no-output-bias", "--attention-heads", "4"]
    assert flags_of({"explicit_embedding_rms": 1.0, "explicit_output_rms": 0.0155, "tied": True}) == [
        "--explicit-embedding-rms", "1", "--explicit-output-rms", "0.0155", "--tied"]
