"""The sdist and the wheel: what each ships and the metadata an index page shows."""

import os
import shutil
import tarfile
import zipfile

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
  from setuptools import build_meta  # pylint: disable=g-import-not-at-top

  out = tmp_path_factory.mktemp("sdist")
  cwd = os.getcwd()
  os.chdir(_REPO)  # the backend builds the project of the working directory
  try:
    name = build_meta.build_sdist(str(out))
  finally:
    os.chdir(cwd)
  with tarfile.open(out / name) as archive:
    members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    metadata = archive.extractfile(next(m for m in archive.getmembers() if m.name.endswith("/PKG-INFO")))
    return members, metadata.read().decode()


def test_the_sdist_ships_tests_docs_benchmarks_and_the_changelog(sdist):
  members, _ = sdist
  for path in ("tests/conftest.py", "tests/unit/test_packaging.py", "tests/workers/crash_worker.py",
               "tests/fixtures/README.md", "docs/storage.md", "docs/guarantees.md", "benchmarks/run_all.py",
               "CHANGELOG.md", "LICENSE", "Makefile", "ckpt_iter/py.typed", "demo/prompts.jsonl", "demo/__main__.py",
               "mkdocs.yml", "docs/hooks.py", "docs/api.md", "docs/README.md"):
    assert path in members, path
  assert not any("__pycache__" in m or m.endswith(".pyc") for m in members)


def test_the_metadata_names_authors_classifiers_and_the_extras(sdist):
  _, metadata = sdist
  assert "Author: ckpt_iter developers" in metadata
  assert "Classifier: Programming Language :: Python :: 3.11" in metadata
  assert "License-Expression: Apache-2.0" in metadata
  for extra in ("gcs", "tunix", "hf", "files", "plot", "test", "test-core", "docs"):
    assert f"Provides-Extra: {extra}" in metadata, extra
  assert "Requires-Dist: grain>=0.2.17" in metadata and "Requires-Dist: jax>=0.8.3" in metadata


def test_the_project_urls_lead_to_the_docs_source_issues_and_changelog(sdist):
  """What an index page links, as ckpt_iter._urls says (test_doc_links.py checks they exist in the repository)."""
  from ckpt_iter import _urls  # pylint: disable=g-import-not-at-top

  _, metadata = sdist
  urls = dict(line.split(": ", 1)[1].split(", ", 1) for line in metadata.splitlines() if line.startswith("Project-URL: "))
  assert urls == {
      "Homepage": _urls.REPOSITORY_URL,
      "Documentation": _urls.DOCS_URL,
      "Source": _urls.REPOSITORY_URL,
      "Issues": _urls.REPOSITORY_URL + "/issues",
      "Changelog": _urls.REPOSITORY_URL + "/blob/main/CHANGELOG.md",
  }, urls


def test_the_tunix_extra_keeps_every_supported_tunix_installed(sdist):
  """pip keeps an installed requirement its specifier allows: main (0.1.8) must be allowed."""
  from packaging.requirements import Requirement  # pylint: disable=g-import-not-at-top

  _, metadata = sdist
  (tunix,) = [Requirement(line.split(": ", 1)[1]) for line in metadata.splitlines()
              if line.startswith("Requires-Dist: google-tunix") and 'extra == "tunix"' in line]
  for version in ("0.1.7", "0.1.8"):  # the versions docs/tunix.md names as tested
    assert tunix.specifier.contains(version), (str(tunix), version)
  assert not tunix.specifier.contains("0.1.6")


def test_the_wheel_holds_the_library_only(tmp_path):
  """No demo, tests or benchmarks in the wheel: the library and what it reads at run time."""
  from setuptools import build_meta  # pylint: disable=g-import-not-at-top

  project = tmp_path / "project"  # a copy: the backend writes build/ into the project it builds
  for name in ("ckpt_iter", "demo", "tests/fixtures/README.md", "pyproject.toml", "README.md", "LICENSE",
               "MANIFEST.in"):
    source, target = os.path.join(_REPO, name), project / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(source):
      shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy(source, target)
  cwd = os.getcwd()
  os.chdir(project)
  try:
    name = build_meta.build_wheel(str(tmp_path / "dist"))
  finally:
    os.chdir(cwd)
  with zipfile.ZipFile(tmp_path / "dist" / name) as wheel:
    tops = {member.split("/", 1)[0] for member in wheel.namelist()}
    members = set(wheel.namelist())
  assert tops == {"ckpt_iter", name.split("-")[0] + "-" + name.split("-")[1] + ".dist-info"}, tops
  assert "ckpt_iter/__init__.py" in members and "ckpt_iter/tunix/example_grpo.yaml" in members
  assert not any(m.startswith(("demo/", "tests/", "benchmarks/")) or "/demo/" in m for m in members)


_USER_EXTRAS = ("files", "hf", "gcs", "tunix", "plot")


@pytest.mark.parametrize("page", ["README.md", "docs/getting_started.md"])
def test_the_extras_tables_name_each_extras_requirements_with_their_floors(page):
  # issue 58 item 7: the tables said `gcsfs`, `optax`, `flax` where pyproject.toml holds floors.
  import re  # pylint: disable=g-import-not-at-top
  import tomllib  # pylint: disable=g-import-not-at-top

  with open(os.path.join(_REPO, "pyproject.toml"), "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
  with open(os.path.join(_REPO, page)) as f:
    rows = {m.group(1): re.findall(r"`([^`]+)`", m.group(2))
            for m in re.finditer(r"^\| `(?:ckpt_iter\[)?(\w[\w-]*)\]?` \| ([^|]+) \|", f.read(), re.M)}
  for extra in _USER_EXTRAS:
    assert rows.get(extra) == extras[extra], (page, extra, rows.get(extra), extras[extra])
