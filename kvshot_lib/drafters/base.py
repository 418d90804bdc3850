"""The drafter interface: what the decoding engine asks of any drafter, at decode time.

Every drafter (the trained hidden/KV/hybrid drafters, the n-gram drafter, a random drafter, the target
drafting for itself) gives the engine a fresh :class:`DraftSession` per generation. A session drafts
one *cycle* at a time, as a tree (a chain is a tree whose every node has one child):

1. ``start_cycle(committed, view)`` — ``committed`` holds all committed token ids ``[1, P+1]``. The last
   one, the *root*, was chosen by the target (its bonus token) and is not in the target's cache yet;
   ``view.cache`` holds exactly positions ``0..P-1``. ``view.hidden[l]`` holds the target's hidden states
   (output of decoder layer ``l``) for the positions committed since the previous call, i.e. positions
   ``P - n_new .. P-1`` (all ``0..P-1`` on the first call). The session ingests them and returns the
   root's draft logits ``[V_draft]``: the distribution of the token after the root (draft step 0).
   ``view.rewritten_from`` (usually None) is the first position whose K/V in ``view.cache`` changed since
   the previous cycle: SpecPV's full pass re-feeds the positions verified only partially, so a session
   that keeps the target's K/V must read positions ``rewritten_from..P-1`` again.
2. ``expand(tokens, parents)`` — adds ``n`` draft nodes (target ids ``tokens [n]``) to the cycle's tree.
   ``parents[i]`` is the index of node ``i``'s parent among all nodes added this cycle (0-based, in call
   order), or ``-1`` if its parent is the root. A node at tree depth ``d`` (root children: ``d = 0``)
   sits at position ``P + 1 + d``. Returns logits ``[n, V_draft]``: the distribution of the token after
   each new node. A node attends to the committed context plus its own ancestors only.
3. ``end_cycle()`` — drop everything added in this cycle; the next ``start_cycle`` brings the verdict.

``d2t`` maps draft-vocabulary ids to target ids (``None`` when the draft vocabulary is the target's).
``hidden_layers`` names the target layers whose hidden states the session needs in ``view.hidden``;
the engine only asks the target for hidden states when it is non-empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor


@dataclass
class TargetView:
    """The target's context as the engine hands it to a drafter at the start of a cycle."""

    cache: object  # transformers DynamicCache with exactly the committed positions 0..P-1
    hidden: dict[int, Tensor]  # layer -> [1, n_new, hidden]: positions committed since the last cycle
    rewritten_from: int | None = None  # positions >= this have new K/V since the last cycle: read them again


@runtime_checkable
class DraftSession(Protocol):
    d2t: Tensor | None  # [V_draft] draft id -> target id; None = identity
    hidden_layers: tuple[int, ...]

    def start_cycle(self, committed: Tensor, view: TargetView) -> Tensor:  # [1, P+1] -> [V_draft]
        ...

    def expand(self, tokens: Tensor, parents: Tensor) -> Tensor:  # [n], [n] -> [n, V_draft]
        ...

    def end_cycle(self) -> None: ...


@runtime_checkable
class SessionFactory(Protocol):
    """Anything the engine can draft with: trained drafters, n-gram, random, the target itself."""

    name: str

    def new_session(self) -> DraftSession:  # one session per generation
        ...
