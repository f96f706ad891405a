"""The saved shardings a Tunix resume puts back (`tunix._shardings.read_saved_layouts`), read from both Orbax APIs' metadata.

Tunix 0.1.7 saves through Orbax v0, Tunix main through v1; their metadata
leaves hold the sharding differently. The 2-process runs that depend on it
(resumed bit for bit only with the saved shardings back) are in
tests/integration/test_tunix_multihost.py, on both Tunix versions.
"""

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp1
import pytest
pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'ckpt_iter[tunix]')")

from ckpt_iter.tunix import _shardings


@pytest.fixture
def tree():
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  return {"w": jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, PartitionSpec("fsdp", None)))}


def test_the_saved_layout_is_read_from_orbax_v0_metadata(tmp_path, tree):
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "v0", tree)
    metadata = checkpointer.metadata(tmp_path / "v0")
  leaf = metadata.item_metadata["w"] if hasattr(metadata, "item_metadata") else metadata["w"]
  assert _shardings._saved_layout(leaf) == (("fsdp", "tp"), ("fsdp", None))  # pylint: disable=protected-access


def test_the_saved_layout_is_read_from_orbax_v1_metadata_without_building_devices(tmp_path, tree):
  """Found on Tunix main: v1's leaf has `sharding_metadata`, and its `.sharding` is a JAX
  sharding with no `partition_spec`, so no layout was read and 2-process resumes were not exact."""
  ocp1.save_pytree(tmp_path / "v1", tree)
  leaf = ocp1.pytree_metadata(tmp_path / "v1").metadata["w"]
  assert _shardings._saved_layout(leaf) == (("fsdp", "tp"), ("fsdp", None))  # pylint: disable=protected-access

  class Unbuildable:  # as on another process count: the devices it names do not exist here
    sharding_metadata = leaf.sharding_metadata

    @property
    def sharding(self):
      raise ValueError("The available devices are different from the devices used to save")

  assert _shardings._saved_layout(Unbuildable()) == (("fsdp", "tp"), ("fsdp", None))  # pylint: disable=protected-access
