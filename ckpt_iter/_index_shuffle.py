"""Grain's `index_shuffle` for many indices at once, in numpy: the same values, one pass over an array.

A shard-aware epoch orders every file of the corpus by Grain's
`index_shuffle` (`_permutation`): one call into Grain's extension a file, about
3 us each, 77 ms an epoch at 20,480 files, in every process. The function is
a small cipher, so it is written here over numpy arrays: its round keys are
what C++'s `std::seed_seq{seed}.generate` makes (the algorithm the C++
standard specifies), and each index is enciphered by a Simon-style Feistel
network on two words of half the block each (the block: the bits `max_index`
needs, at least 16, even), enciphered again until it is at most `max_index`
(cycle walking, which keeps it a permutation of [0, max_index]).

Exactness is not assumed: `agrees()` compares this with Grain's extension on
values of every block size the first time it is asked (`_permutation` uses
this only then), and tests/unit/test_index_shuffle.py holds the two equal on
drawn sizes, seeds and indices.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

_MASK32 = 0xFFFFFFFF
_MIN_BLOCK_BITS = 16


def seed_sequence(seed: int, count: int) -> list[int]:
  """The `count` 32-bit words `std::seed_seq{seed}.generate` writes (C++ [rand.util.seedseq])."""
  entropy = [seed & _MASK32]
  words = [0x8B8B8B8B] * count
  t = 11 if count >= 623 else 7 if count >= 68 else 5 if count >= 39 else 3 if count >= 7 else (count - 1) // 2
  p = (count - t) // 2
  q = p + t
  mix = lambda x: x ^ (x >> 27)  # pylint: disable=unnecessary-lambda-assignment
  steps = max(len(entropy) + 1, count)
  for k in range(steps):
    r1 = (1664525 * mix(words[k % count] ^ words[(k + p) % count] ^ words[(k - 1) % count])) & _MASK32
    added = len(entropy) if k == 0 else k % count + entropy[k - 1] if k <= len(entropy) else k % count
    r2 = (r1 + added) & _MASK32
    words[(k + p) % count] = (words[(k + p) % count] + r1) & _MASK32
    words[(k + q) % count] = (words[(k + q) % count] + r2) & _MASK32
    words[k % count] = r2
  for k in range(steps, steps + count):
    r3 = (1566083941 * mix((words[k % count] + words[(k + p) % count] + words[(k - 1) % count]) & _MASK32)) & _MASK32
    r4 = (r3 - k % count) & _MASK32
    words[(k + p) % count] ^= r3
    words[(k + q) % count] ^= r4
    words[k % count] = r4
  return words


def block_bits(max_index: int) -> int:
  """The cipher's block for [0, max_index]: ceil(log2(max_index)) bits made even, 16 to 64."""
  bits = math.ceil(math.log2(float(max_index)))  # as a double, the way the extension takes it
  bits = max(bits + bits % 2, _MIN_BLOCK_BITS)
  return bits if bits <= 62 else 64


def index_shuffle(indices: np.ndarray | Sequence[int], max_index: int, seed: int, rounds: int = 4) -> np.ndarray:
  """Grain's `index_shuffle(i, max_index, seed, rounds)` of each i of `indices` (each in [0, max_index])."""
  values = np.asarray(indices, dtype=np.uint64)
  if max_index == 0:
    return np.zeros_like(values)
  word = block_bits(max_index) // 2
  mask = np.uint64((1 << word) - 1)
  keys = [np.uint64(k & ((1 << word) - 1)) for k in seed_sequence(seed, rounds)]
  shifts = {r: (np.uint64(r), np.uint64(word - r)) for r in (1, 2, 8)}

  def rotate(x: np.ndarray, r: int) -> np.ndarray:
    left, right = shifts[r]
    return ((x << left) | (x >> right)) & mask

  def encipher(value: np.ndarray) -> np.ndarray:
    high, low = (value >> np.uint64(word)) & mask, value & mask
    for i in range(0, rounds, 2):
      high = high ^ ((rotate(low, 1) & rotate(low, 8)) ^ rotate(low, 2)) ^ keys[i]
      low = low ^ ((rotate(high, 1) & rotate(high, 8)) ^ rotate(high, 2)) ^ keys[i + 1]
    return (high << np.uint64(word)) | low

  limit = np.uint64(max_index)
  out = encipher(values)
  over = np.flatnonzero(out > limit)
  while over.size:  # cycle walking: every cycle holds its start, which is in range
    out[over] = encipher(out[over])
    over = over[out[over] > limit]
  return out


# A max_index for each block size from 16 to 64 bits (each checked under a seed of its own): what `agrees` checks.
_CHECKED_MAX = [2**bits - 1 - bits for bits in range(15, 63, 2)] + [2**62 + 12345, 2**63 - 1]


def agrees(compiled: Callable[[int, int, int, int], int], rounds: int = 4) -> bool:
  """Whether this computes what Grain's extension `compiled` does, on values of every block size."""
  for n, max_index in enumerate(_CHECKED_MAX):
    seed = (2654435761 * (n + 1)) & _MASK32
    indices = [0, 1, max_index // 3, max_index - 1, max_index]
    if index_shuffle(indices, max_index, seed, rounds).tolist() != [compiled(i, max_index, seed, rounds)
                                                                       for i in indices]:
      return False
  return True
