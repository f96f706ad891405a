"""A missing optional package is named with the install line that brings it, floors included.

The floors are pyproject.toml's `files` extra: a message that says only
`pip install pyarrow` could install a version the package was never run on.
"""

import io
import pathlib
import sys
import tomllib

import grain
import pytest

from ckpt_iter import errors
from ckpt_iter import sources
from ckpt_iter.cli import _which

_REPO = pathlib.Path(__file__).resolve().parents[2]
_FILES_EXTRA = tomllib.loads((_REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["files"]


def _requirement(name: str) -> str:
  (requirement,) = [r for r in _FILES_EXTRA if r.startswith(name)]
  return requirement


def test_reading_parquet_without_pyarrow_names_the_extra_and_the_floor(monkeypatch):
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` raises ImportError
  with pytest.raises(errors.InvalidArgumentError) as e:
    sources._import_pyarrow_parquet()  # pylint: disable=protected-access
  assert "pip install 'ckpt_iter[files]'" in str(e.value) and _requirement("pyarrow") in str(e.value), e.value


def test_order_to_parquet_without_pyarrow_names_the_extra_and_the_floor(monkeypatch):
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  with pytest.raises(errors.InvalidArgumentError) as e:
    _which._parquet_writer(io.BytesIO(), iter([]))  # pylint: disable=protected-access
  assert "pip install 'ckpt_iter[files]'" in str(e.value) and _requirement("pyarrow") in str(e.value), e.value


def test_reading_array_record_without_it_names_the_extra_and_the_floor(monkeypatch, tmp_path):
  path = tmp_path / "records.array_record"
  path.write_bytes(b"")

  def missing(paths):
    raise ImportError("No module named 'array_record'")

  monkeypatch.setattr(grain.sources, "ArrayRecordDataSource", missing)
  with pytest.raises(errors.InvalidArgumentError) as e:
    sources.ArrayRecordSource(str(path))
  assert "pip install 'ckpt_iter[files]'" in str(e.value) and _requirement("array-record") in str(e.value), e.value


def test_every_runtime_requirement_has_a_floor():
  """What a user installs (the dependencies and the user-facing extras) names the lowest version it runs on."""
  project = tomllib.loads((_REPO / "pyproject.toml").read_text())["project"]
  extras = project["optional-dependencies"]
  user_facing = [r for name in ("files", "hf", "gcs", "tunix", "plot") for r in extras[name]]
  assert [r for r in project["dependencies"] + user_facing if ">=" not in r and "==" not in r] == []
  assert "Programming Language :: Python :: 3.12" in project["classifiers"]


@pytest.mark.parametrize("argv", [["inspect"], ["verify"], ["audit"], ["which", "--step", "1"],
                                  ["order", "--out", "order.jsonl"], ["diff", "gs://bucket/other"]],
                         ids=lambda argv: argv[0])
def test_every_verb_on_a_bucket_without_the_gcs_extra_says_so_in_one_line(argv, monkeypatch, capsys):
  # issue 66 item 13: a 25-31-line traceback, where the Python API said it in one line.
  import support  # pylint: disable=g-import-not-at-top

  monkeypatch.setitem(sys.modules, "gcsfs", None)  # `import gcsfs` raises ImportError
  code, out = support.cli_output(argv[0], "gs://bucket/run", *argv[1:])
  lines = [line for line in out.splitlines() if line.strip()]
  assert code == 1 and len(lines) == 1 and "pip install 'ckpt_iter[gcs]'" in lines[0], out
  with pytest.raises(errors.MissingPackageError, match=r"pip install 'ckpt_iter\[gcs\]'"):
    from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top
    _storage.list_names("gs://bucket/run")
