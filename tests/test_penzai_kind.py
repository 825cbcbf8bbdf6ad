"""penzai's transformers as a registered model kind (``saffu train --model penzai``): the config
is plain data that ``saffu train --config`` reads and a run folder gives back; with penzai
installed (``.[models]``), a tiny Llama-like model trains from a run spec, its run folder reloads
for ``saffu eval`` and resumes, and an explicit start sets exactly the embeddings and the output
kernel."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from saffu import configs
from saffu._io import SaffuError
from saffu.cli import build_parser, main
from saffu.flags import model_from_args, spec_defaults
from saffu.models.interface import config_from_dict, kind_of

TINY = {"start": {"init": "random", "model": "penzai"},
        "model": {"kind": "penzai", "family": "llama", "width": 16, "layers": 1, "heads": 2, "mlp": 24,
                  "context_tokens": 4},
        "train": {"steps": 3, "batch_size": 2, "seq_len": 8, "eval_every": 3}, "eval": {"eval_tokens": 0}}


def _rms(x) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def test_a_penzai_config_is_plain_data_a_spec_and_a_run_folder_give_back(tmp_path):
    """No penzai needed: the registry knows the kind, a run's ``config.json`` form loads back to
    the same config, a spec's model section becomes ``saffu train``'s flags (width, layers, heads
    and context shared with the transformer's, with its defaults), and what penzai cannot build
    is refused in one line."""
    config = configs.PenzaiConfig(300, "neox", width=16, layers=1, heads=2, mlp=24, context_tokens=4)
    assert kind_of(config).name == "penzai" and kind_of(config).explicit_init is not None
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(config)))) == config
    assert config.selectors() == {"embedding": configs.PENZAI_EMBEDDING, "output": configs.PENZAI_OUTPUT}
    assert config.forward_flops(8) > 0 and config.context == 4
    (tmp_path / "spec.json").write_text(json.dumps({**TINY, "model": {**TINY["model"], "family": "neox"}}))
    defaults = spec_defaults(tmp_path / "spec.json")
    assert defaults["model"] == "penzai" and defaults["family"] == "neox" and defaults["attention_heads"] == 2
    args = build_parser().parse_args(["train", "--workdir", "w", "--run", "r", "--init", "random", "--model", "penzai",
                                      "--family", "neox", "--width", "16", "--layers", "1", "--attention-heads", "2",
                                      "--mlp-width", "24", "--context", "4"])
    assert model_from_args("penzai", args, 300) == config
    default = model_from_args("penzai", build_parser().parse_args(["train", "--workdir", "w", "--run", "r",
                                                                   "--init", "random"]), 300)
    assert default == configs.PenzaiConfig(300)         # the transformer's flags' defaults are penzai's
    with pytest.raises(SaffuError, match="family"):
        configs.PenzaiConfig(300, "gpt2")
    with pytest.raises(SaffuError, match="tied"):
        configs.PenzaiConfig(300, "neox", tied=True)
    with pytest.raises(SaffuError, match="explicit-tied"):
        configs.StartConfig(explicit_tied="sum")


def test_the_registry_imports_no_penzai():
    """penzai stays an optional extra: the model registry and ``saffu train``'s parser load without it."""
    code = ("import sys, saffu.models.interface, saffu.cli; saffu.cli.build_parser(); "
            "assert 'penzai' not in sys.modules, 'penzai imported'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_a_tiny_penzai_llama_trains_from_a_spec_reloads_for_eval_and_resumes(tiny_workdir, tmp_path, capsys):
    pytest.importorskip("penzai")
    spec, run = tmp_path / "spec.json", tmp_path / "run"
    spec.write_text(json.dumps(TINY))
    common = ["--workdir", str(tiny_workdir.path), "--run", str(run), "--quiet"]
    assert main(["train", "--config", str(spec), *common, "--metrics-json", str(tmp_path / "train.json")]) == 0
    trained = json.loads((tmp_path / "train.json").read_text())
    assert trained["model"] == "penzai" and trained["steps"] == 3 and np.isfinite(trained["dev_loss"])
    record = json.loads((run / "config.json").read_text())["model"]
    assert record == {**dataclasses.asdict(configs.PenzaiConfig(tiny_workdir.vocab_size, width=16, layers=1, heads=2,
                                                                mlp=24, context_tokens=4))}
    assert main(["eval", *common, "--metrics-json", str(tmp_path / "eval.json")]) == 0
    scored = json.loads((tmp_path / "eval.json").read_text())
    assert scored["dev_loss"] == pytest.approx(trained["dev_loss"], rel=1e-5)
    capsys.readouterr()
    assert main(["train", "--config", str(spec), *common[:-1]]) == 0        # finished: nothing to train
    assert "had already finished its 3 steps" in capsys.readouterr().out


@pytest.mark.parametrize("tied", [False, True])
def test_an_explicit_penzai_start_sets_the_embeddings_and_the_output_kernel(tiny_workdir, tied):
    """The explicit start (:func:`saffu.training.recipes.explicit_start`): the embeddings at the
    RMS asked for (tied: the one matrix at its random scale), the untied output kernel at its random
    RMS, every other leaf penzai's random init; no pieces: only the embeddings rescaled."""
    pytest.importorskip("penzai")
    from saffu.models.interface import model_init
    from saffu.training.recipes import explicit_start
    config = configs.PenzaiConfig(tiny_workdir.vocab_size, width=16, layers=1, heads=2, mlp=24, tied=tied,
                                  context_tokens=4)
    key, solver = jax.random.key(0), configs.FactorConfig(holdout_tokens=64)
    random = model_init(config, key)
    start = configs.StartConfig(init="explicit", model="penzai", explicit_embedding_rms=None if tied else 1.0)
    params, seconds, report = explicit_start(tiny_workdir, config, key, start, solver)
    changed = {label for label in random if not np.array_equal(np.asarray(random[label]), np.asarray(params[label]))}
    assert changed == set(config.selectors().values()) and seconds > 0 and report
    embedding = params[configs.PENZAI_EMBEDDING]
    assert _rms(embedding) == pytest.approx(_rms(random[configs.PENZAI_EMBEDDING]) if tied else 1.0, rel=1e-4)
    if not tied:
        assert _rms(params[configs.PENZAI_OUTPUT]) == pytest.approx(_rms(random[configs.PENZAI_OUTPUT]), rel=1e-4)
    ablation = dataclasses.replace(start, explicit_pieces=(), explicit_embedding_rms=1.0)
    params, seconds, report = explicit_start(tiny_workdir, config, key, ablation, solver)
    changed = {label for label in random if not np.array_equal(np.asarray(random[label]), np.asarray(params[label]))}
    assert changed == {configs.PENZAI_EMBEDDING} and report == {}
    np.testing.assert_allclose(np.asarray(params[configs.PENZAI_EMBEDDING]),
                               np.asarray(random[configs.PENZAI_EMBEDDING]) / _rms(random[configs.PENZAI_EMBEDDING]),
                               rtol=1e-5)
