"""`RadixTree`: one radix tree of cached blocks shared by every attention window.

A *position* is one block of a token path; it holds at most one block per window. Positions
are stored in compressed edges (a node is a run of consecutive positions, split where paths
diverge, as in SGLang's radix tree). The tree is one set of int columns, and its code is split
by concern, each part a class over the same columns:

  radix_nodes     `RadixNodes`: node and position storage; attach, detach, prune, split
  radix_match     `RadixMatch`: lookups (exact walk, best partial match, find)
  radix_insert    `RadixInsert`: storing a path's blocks
  event_records   `TreeEventRecords`: chained block hashes and Stored-event contents
  sorted_firsts   `SortedFirsts`: a node's index of its children's first blocks
"""
from __future__ import annotations

from kvjax.ledger.event_records import TreeEventRecords
from kvjax.ledger.radix_insert import RadixInsert
from kvjax.ledger.radix_match import RadixMatch
from kvjax.ledger.radix_nodes import NO_BLOCK, ROOT, RUN_LIMIT


class RadixTree(RadixInsert, RadixMatch, TreeEventRecords):
    """The tree the block manager owns: `RadixTree(tokens_per_block, blocks_per_window,
    hasher)` (see `TreeEventRecords.__init__`)."""


__all__ = ["NO_BLOCK", "ROOT", "RUN_LIMIT", "RadixTree"]
