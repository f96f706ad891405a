"""The restart options of `ckpt-iter train` (ckpt_iter.tunix.cli), without a Tunix run."""

import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")
import yaml

import ckpt_iter
from ckpt_iter import errors
from ckpt_iter.tunix import cli


def _config(tmp_path, section=None):
  body = {"batch_size": 2}
  if section is not None:
    body["ckpt_iter"] = section
  path = tmp_path / "config.yaml"
  path.write_text(yaml.safe_dump(body))
  return str(path)


@pytest.mark.parametrize("kind, section, arguments, expected", [
    # A run started with Tunix's own command continues like stock by default.
    ("grpo", None, [], {"on_legacy_checkpoint": "fast_forward", "allow_drift": ()}),
    ("grpo", {"on_legacy_checkpoint": "raise"}, [], {"on_legacy_checkpoint": "raise", "allow_drift": ()}),
    # The command line wins over the file; allow_drift as a comma list or a YAML list.
    ("grpo", {"on_legacy_checkpoint": "raise"}, ["ckpt_iter.on_legacy_checkpoint=fast_forward"],
     {"on_legacy_checkpoint": "fast_forward", "allow_drift": ()}),
    ("ppo", None, ["ckpt_iter.allow_drift=train_micro_batch_size,seed"],
     {"on_legacy_checkpoint": "fast_forward", "allow_drift": ("train_micro_batch_size", "seed")}),
    ("sft", {"allow_drift": ["seed"]}, [], {"allow_drift": ("seed",)}),
    ("sft", {"skip": "records:10-19"}, ["ckpt_iter.skip=records:1200-1263;source:3"],
     {"allow_drift": (), "skip": ckpt_iter.Skip(records=[(1200, 1264)], source_records=[(3, 4)])}),
])
def test_options_come_from_the_config_section_and_the_command_line(tmp_path, kind, section, arguments, expected):
  options, rest = cli.train_options(kind, _config(tmp_path, section), [*arguments, "data_config.seed=1"])
  assert options == expected
  assert rest == ["data_config.seed=1"]  # only Tunix's own overrides reach Tunix


@pytest.mark.parametrize("kind, arguments, message", [
    ("grpo", ["ckpt_iter.on_legacy=raise"], "ckpt_iter.on_legacy is not an option"),
    ("grpo", ["ckpt_iter.on_legacy_checkpoint=skip"], "on_legacy_checkpoint='skip': expected one of raise"),
    ("sft", ["ckpt_iter.on_legacy_checkpoint=raise"], "does not apply to the sft pipeline"),
    ("grpo", ["ckpt_iter.skip=rows:1-2"], "ckpt_iter.skip: skip 'rows:1-2': 'rows:1-2' is not"),
])
def test_bad_options_are_refused_naming_them(tmp_path, kind, arguments, message):
  with pytest.raises(cli._Usage, match=message):  # pylint: disable=protected-access
    cli.train_options(kind, _config(tmp_path), arguments)


def test_the_learner_takes_the_options_unless_its_caller_passes_them():
  class Learner:
    def train(self, train_ds, eval_ds=None, *, on_legacy_checkpoint="raise", allow_drift=()):
      return on_legacy_checkpoint, allow_drift

  configured = cli._with_train_options(Learner, {"on_legacy_checkpoint": "fast_forward"})  # pylint: disable=protected-access
  assert issubclass(configured, Learner) and configured.__qualname__ == Learner.__qualname__
  assert configured().train([]) == ("fast_forward", ())
  assert configured().train([], on_legacy_checkpoint="raise") == ("raise", ())


def test_a_skip_option_is_declared_on_the_training_data():
  class Learner:
    def train(self, train_ds, eval_ds=None, *, allow_drift=()):
      return train_ds

  data = ckpt_iter.make_dataset([{"x": i} for i in range(8)], batch_size=2, shard_index=0, shard_count=1)
  skip = ckpt_iter.Skip(records=[(2, 4)])
  configured = cli._with_train_options(Learner, {"allow_drift": (), "skip": skip})  # pylint: disable=protected-access
  assert configured().train(data) is data and data.declared == skip
  assert [list(b["x"]) for b in ckpt_iter.DataIterator(data)][:2] == [[0, 1], [4, 5]]


def test_the_example_config_a_wheel_user_can_print_is_the_one_the_docs_show(capsys):
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top

  assert cli.main(["--example-config"]) == cli.EXIT_OK
  printed = capsys.readouterr().out
  config = yaml.safe_load(printed)
  assert config["data_module"] == "ckpt_iter.tunix.data" and config["grpo_config"]["num_iterations"] == 2
  docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "tunix_cli.md").read_text()
  assert printed in re.findall(r"```yaml\n(.*?)```", docs, re.S)
  assert cli.main(["--help"]) == cli.EXIT_OK
  assert "--example-config` prints a complete GRPO config" in capsys.readouterr().out


def test_the_command_line_allow_drift_hint_is_bounded_however_many_fields_differ():
  few = errors.ConfigDriftError({"seed": (0, 1), "content.tokens": ("a", "b")})
  assert cli._command_line_way(few) == " On this command line: ckpt_iter.allow_drift=content.tokens,seed"  # pylint: disable=protected-access
  many = errors.ConfigDriftError({f"input.node[{i}].MapDataset.fn_code": (i, -i) for i in range(200_000)})
  way = cli._command_line_way(many)  # pylint: disable=protected-access
  assert len(way) < 1024, len(way)
  assert "all 200,000 of them" in way and "input.node[0].MapDataset.fn_code," in way, way
