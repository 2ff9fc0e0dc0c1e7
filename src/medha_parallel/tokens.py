"""One rank's sampled token ids, sent to every rank of the world.

With async scheduling (a decode issued before its previous token is back)
every rank that embeds tokens must learn the token the previous batch sampled,
and only one rank samples. :class:`TokenBroadcast` sends that rank's ids to
every other rank: one ``int64`` tensor (the count, then the ids) on a gloo group of the whole world
(made for it, so the ids never share a queue with the model's collectives and
stay on the host whatever the model's device). Failures and timeouts raise
:class:`~medha_parallel.errors.CommunicationError` naming ``world`` and
``broadcast_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from medha_parallel.errors import named_comm
from medha_parallel.state import ParallelState


class TokenBroadcast:
    """Token ids from rank ``src`` to every rank of ``state``'s world.

    Building one is collective (it creates a process group): every rank
    builds it, at the same point of its start-up. With a world of one rank
    nothing is created and :meth:`broadcast` hands the ids back.

    Args:
        state: this rank's parallel state (its layout gives the world size).
        src: the global rank whose ids are sent (``0 <= src < world size``).

    Attributes:
        rank: this rank's global rank.
        src: the sending rank.
    """

    def __init__(self, state: ParallelState, *, src: int) -> None:
        world = state.layout.world_size
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
            raise ValueError(f"src must be a rank in [0, {world}), got {src!r}")
        self.rank, self.src, self.world_size = state.rank, src, world
        self.group: dist.ProcessGroup | None = None
        if world > 1:
            with named_comm("world", "new_group"):
                self.group = dist.new_group(
                    list(range(world)), timeout=state.timeout, backend="gloo"
                )

    def __repr__(self) -> str:
        return f"TokenBroadcast(rank={self.rank}, src={self.src}, world_size={self.world_size})"

    def broadcast(self, ids: Sequence[int] | None, count: int) -> list[int]:
        """Rank ``src``'s ``count`` token ids, on every rank.

        Args:
            ids: on rank ``src``, ``count`` ints; ignored elsewhere (pass None).
            count: how many ids are sent; the same on every rank (0: no
                communication, ``[]``).

        Returns:
            The ids, as a list of ``count`` ints, the same on every rank.

        The count travels ahead of the ids: a rank that expects another count
        than the sender's gets a :class:`CommunicationError` saying both.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if self.rank == self.src:
            if ids is None or len(ids) != count:
                got = None if ids is None else len(ids)
                raise ValueError(f"rank {self.src} sends {count} token ids, got {got}")
            if self.group is None or count == 0:
                return list(ids)
            buf = torch.tensor([count, *ids], dtype=torch.int64)
        else:
            if count == 0:
                return []
            buf = torch.empty(count + 1, dtype=torch.int64)
        with named_comm("world", "broadcast_tokens"):
            dist.broadcast(buf, src=self.src, group=self.group)
            sent, *got = buf.tolist()
            if sent != count:
                raise ValueError(
                    f"rank {self.rank} expects {count} token ids, rank {self.src} sent {sent}"
                )
        return got
