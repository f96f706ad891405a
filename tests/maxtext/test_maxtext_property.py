"""Drawn chains over MaxText's own packed rows: any host counts and global batches, every lane's rows once.

In one process, `ckpt_iter.maxtext.train_dataset` builds the pipeline each of
P simulated hosts reads (MaxText's config from its `pyconfig`, its tokenizer,
first-fit packing in lanes); each segment of a drawn chain reads some global
batches, saves every host's state as a pod writes it (`_item.write`, a file a
host and the count file), reads a few more that are lost (a preemption), and
the next segment's Q hosts restore it elastically (`_item.read_item`, the
restore MaxText's `load_state_if_possible` reaches through `TrainData.load`).
Every lane's rows, compared as bytes with an uninterrupted run's: the same
rows in the same order (no row twice, none passed over).

Runs only in `make test-maxtext` (Python 3.12, MaxText installed).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import hypothesis
from hypothesis import strategies as st
import pytest

pytest.importorskip("maxtext", reason="make test-maxtext installs MaxText (Python 3.12)")

import maxtext_jobs  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import _item  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import iterator as iterator_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from ckpt_iter import maxtext  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_LANES = 12
GLOBAL_BATCHES = (12, 24)
HOSTS = (1, 2, 3, 4, 6)

_CORPUS = Path(tempfile.mkdtemp(prefix="maxtext_property_"))
atexit.register(shutil.rmtree, _CORPUS, True)
for _f in range(2):
  maxtext_jobs.write_parquet(_CORPUS / f"train-{_f}.parquet", range(_f * 100, _f * 100 + 60))
_CONFIGS: dict[int, object] = {}


def _config(global_batch: int):
  """MaxText's config (its pyconfig) for a global batch on this one-device process."""
  if global_batch not in _CONFIGS:
    import maxtext as maxtext_package  # pylint: disable=g-import-not-at-top
    from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top

    package = Path(maxtext_package.__file__).parent
    _CONFIGS[global_batch] = pyconfig.initialize([
        None, str(package / "configs" / "base.yml"), "run_name=p", f"base_output_directory={_CORPUS}/out",
        "dataset_type=grain", f"grain_train_files={_CORPUS}/*.parquet", "grain_file_type=parquet",
        f"per_device_batch_size={global_batch}", "max_target_length=32", "packing=true", "grain_worker_count=0",
        f"tokenizer_path={package / 'assets' / 'tokenizers' / 'tokenizer.default'}", "data_shuffle_seed=5",
        "skip_jax_distributed_system=true"])
  return _CONFIGS[global_batch]


def _hosts(global_batch: int, count: int) -> list:
  return [iterator_lib.DataIterator(maxtext.train_dataset(
      _config(global_batch), shard_index=i, shard_count=count, num_lanes=NUM_LANES, chunk_size=8))
          for i in range(count)]


def _global_batch(hosts) -> list[bytes]:
  """The global batch's rows in order (host i holds lanes [i*V/P, (i+1)*V/P)), each row's fields as bytes."""
  rows = []
  for batch in (next(h) for h in hosts):
    for j in range(len(batch["inputs"])):
      rows.append(b"".join(batch[k][j].tobytes() for k in sorted(batch)))
  return rows


_REFERENCE: list[list[bytes]] = []


def _reference(batches: int) -> list[list[bytes]]:
  """An uninterrupted one-host run's global batches of NUM_LANES rows (one row a lane)."""
  if len(_REFERENCE) < batches:
    hosts = _hosts(NUM_LANES, 1)
    _REFERENCE[:] = [_global_batch(hosts) for _ in range(batches)]
  return _REFERENCE[:batches]


def _trained(root: str, segments) -> tuple[list[list[bytes]], object]:
  """The global batches a chain of segments (hosts, batches saved, batches lost) trained, each segment's hosts
  restoring the last step saved as MaxText's `load_state_if_possible` reaches it, and that step's process 0 state."""
  trained, step = [], 0
  for number, (hosts, saved, lost) in enumerate(segments):
    count = len(hosts)
    if number:
      for index, host in enumerate(hosts):
        restored = _item.read_item(f"{root}/{step}/data", index, count, elastic=True)
        _item.check_restore_saved(host, restored, allow_drift=maxtext.MIXTURE_CHANGES)()
    for _ in range(saved):
      trained.append(_global_batch(hosts))
      step += 1
      os.makedirs(f"{root}/{step}/data")
      for index, host in enumerate(hosts):
        header, arrays = _item.snapshot(host, step)
        _item.write(f"{root}/{step}/data", header, arrays, index, count)
    for _ in range(lost):
      _global_batch(hosts)  # read, never saved: the next segment reads these rows again
  return trained, _item.read_item(f"{root}/{step}/data", 0, len(segments[-1][0])).value


@st.composite
def _chains(draw):
  return [(draw(st.sampled_from(HOSTS)), draw(st.sampled_from(GLOBAL_BATCHES)), draw(st.integers(1, 3)),
           draw(st.integers(0, 2))) for _ in range(draw(st.integers(2, 4)))]


@hypothesis.settings(max_examples=int(os.environ.get("CKPT_ITER_MAXTEXT_EXAMPLES", "20")), deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(_chains())
def test_any_chain_of_host_counts_and_global_batches_trains_every_lanes_rows_once(chain):
  with tempfile.TemporaryDirectory() as root:
    trained, _ = _trained(root, [(_hosts(global_batch, count), saved, lost)
                                 for count, global_batch, saved, lost in chain])
    lanes = maxtext_jobs.lanes(trained, NUM_LANES)
    reference = maxtext_jobs.lanes(_reference(len(lanes[0])), NUM_LANES)
    assert [len(lane) for lane in lanes] == [len(lane) for lane in reference]
    assert lanes == reference


# ---------------------------------------------------------------------------
# A packed mixture reweighted and given a source between segments (`ckpt_iter/_lane_mixture.py`).

_MIX_CORPUS = _CORPUS / "mixture"
_MIX_CORPUS.mkdir()
for _name, _first in (("a", 1000), ("b", 2000), ("c", 3000)):
  maxtext_jobs.write_parquet(_MIX_CORPUS / f"{_name}-0.parquet", range(_first, _first + 400))
_MIX_CONFIGS: dict[tuple, object] = {}


def _mix_config(global_batch: int, weights: tuple):
  """MaxText's config for `grain_train_files` 'pattern,weight;...' of `weights` ((name, weight), ...)."""
  key = (global_batch, weights)
  if key not in _MIX_CONFIGS:
    import maxtext as maxtext_package  # pylint: disable=g-import-not-at-top
    from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top

    package = Path(maxtext_package.__file__).parent
    files = ";".join(f"{_MIX_CORPUS}/{name}-*.parquet,{weight}" for name, weight in weights)
    _MIX_CONFIGS[key] = pyconfig.initialize([
        None, str(package / "configs" / "base.yml"), "run_name=m", f"base_output_directory={_CORPUS}/out",
        "dataset_type=grain", f"grain_train_files={files}", "grain_file_type=parquet",
        f"per_device_batch_size={global_batch}", "max_target_length=32", "packing=true", "grain_worker_count=0",
        f"tokenizer_path={package / 'assets' / 'tokenizers' / 'tokenizer.default'}", "data_shuffle_seed=5",
        "skip_jax_distributed_system=true"])
  return _MIX_CONFIGS[key]


def _mix_dataset(global_batch: int, weights: tuple, index: int = 0, count: int = 1):
  return maxtext.train_dataset(_mix_config(global_batch, weights), shard_index=index, shard_count=count,
                               num_lanes=NUM_LANES, chunk_size=8)


@st.composite
def _mixture_chains(draw):
  names = ["a", "b"]
  chain = []
  for _ in range(draw(st.integers(2, 4))):
    if len(names) < 3 and draw(st.booleans()):
      names.append("c")
    weights = tuple((name, draw(st.integers(1, 3))) for name in names)
    chain.append((draw(st.sampled_from(HOSTS)), draw(st.sampled_from(GLOBAL_BATCHES)), draw(st.integers(1, 3)),
                  draw(st.integers(0, 2)), weights))
  return chain


@hypothesis.settings(max_examples=int(os.environ.get("CKPT_ITER_MAXTEXT_EXAMPLES", "20")) // 2, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(_mixture_chains())
def test_a_packed_mixture_reweighted_or_grown_between_host_counts_trains_every_lanes_rows_once(chain):
  """Every lane's rows are those of an uninterrupted one-host run under the shares the last state records:
  the rows read before a change were mixed as it says, none twice, none passed over (each source's own
  order under those shares: tests/unit/test_lane_mixture.py)."""
  from ckpt_iter import _lane_mixture, _records  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as root:
    trained, last = _trained(root, [
        ([iterator_lib.DataIterator(_mix_dataset(global_batch, weights, i, count)) for i in range(count)], saved, lost)
        for count, global_batch, saved, lost, weights in chain])
  lanes = maxtext_jobs.lanes(trained, NUM_LANES)
  # The uninterrupted run: one host, every lane from its start, under the last state's shares.
  schedule = _lane_mixture.of(_records.shares_of(last.fingerprint), last.position, origin="the last state")
  uninterrupted = iter(_mix_dataset(NUM_LANES, chain[-1][4]))
  start = {_records.FIRST_LANE: 0, _records.LANES: [[0, 0]] * NUM_LANES}
  uninterrupted.set_state({**start, _lane_mixture.MIXTURE: schedule.to_json()} if not schedule.is_initial else start)
  reference = maxtext_jobs.lanes([_global_batch([uninterrupted]) for _ in range(len(lanes[0]))], NUM_LANES)
  assert lanes == reference
  assert len(schedule.segments) <= len(chain)
