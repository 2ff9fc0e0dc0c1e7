"""Multi-node (or torchrun) runs: where ranks meet, and how long anything may wait.

Every rank of a :class:`~medha_runtime.dist_executor.DistributedExecutor`
joins one ``torch.distributed`` world at ``MASTER_ADDR:MASTER_PORT``
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` are set in each
process; the driver is rank 0 and hosts the store unless torchrun's agent
does) and then one extra gloo *control* group that carries pickled messages
from the driver (step plans, keepalives, shutdown) and the sampling rank's
sampled rows back to it. Outside torchrun every rank first checks in on the
store (:func:`check_in`): a rank whose world size, ranks per node, MODEL or
engine flags differ from the driver's, or whose rank another process holds
already, fails at once with the reason (and so does the driver while it waits),
instead of waiting the whole start bound in silence. Under torchrun the ranks
compare the driver's Medha version, MODEL and engine flags with their own right
after joining (:func:`agree`), and every rank fails with the reasons.

Bounds (nothing waits forever):

- ``start_timeout_s``: joining the world (every rank must have started) and
  the default group's collectives: the start-up exchange, the runner spec
  out and each rank's readiness back once it has built its model (object
  collectives on the default group run on gloo).
- ``control_timeout_s``: any one wait on the control group, e.g. a worker
  waiting for the next message or the driver waiting for the sampling rank.
  The driver sends a keepalive every ``keepalive_s`` while it has nothing to
  run, so an idle server does not time out; a driver that hangs ends its
  workers after at most ``control_timeout_s``. A driver or peer that *dies*
  ends the others at once (gloo raises on a closed connection).
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any

from medha_runtime.version import medha_version

#: the longest wait torch.distributed takes (a store's waits count nanoseconds: 1e10 s
#: overflows, and timedelta refuses inf)
MAX_WAIT_S = 1e8


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """Where the ranks of one model meet and what the driver's node runs.

    Attributes:
        world_size: ranks in all (``tp * spp * kvp``), at least 2.
        master_addr: the rendezvous host (the driver's node).
        master_port: the rendezvous port.
        local_ranks: ranks on the driver's node (ranks ``0 .. local_ranks - 1``;
            it sizes CPU threads and the GPU check).
        start_local: whether the driver (rank 0) starts ranks ``1 .. local_ranks - 1``
            as worker processes; False under torchrun, which starts them itself.
        start_timeout_s: bound on joining the world (see the module docstring).
        control_timeout_s: bound on one wait on the control group.
        keepalive_s: the driver's keepalive period while idle (< control_timeout_s).
        model: the MODEL this node was told to serve (``serve``'s argument), compared
            with the driver's at check-in (every rank runs the driver's); None: not
            compared.
        engine_flags: ``(flag, value as text)`` for each engine flag this node was
            started with (``serve``'s ``--dtype``, ``--max-model-len``, ...),
            compared with the driver's at check-in (every rank runs the driver's
            engine); empty: not compared.
    """

    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    local_ranks: int = 1
    start_local: bool = True
    start_timeout_s: float = 600.0
    control_timeout_s: float = 600.0
    keepalive_s: float = 5.0
    model: str | None = None
    engine_flags: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 2)
        check_int("local_ranks", self.local_ranks, 1)
        check_int("master_port", self.master_port, 1)
        if self.master_port > 65535:
            raise ValueError(f"master_port must be at most 65535, got {self.master_port}")
        if self.local_ranks > self.world_size:
            raise ValueError(f"local_ranks={self.local_ranks} exceeds world_size={self.world_size}")
        if not isinstance(self.start_local, bool):
            raise ValueError(f"start_local must be True or False, got {self.start_local!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a host name, got {self.master_addr!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be None or a model name, got {self.model!r}")
        flags = self.engine_flags
        if not isinstance(flags, tuple) or not all(
            isinstance(f, tuple) and len(f) == 2 and all(isinstance(x, str) for x in f)
            for f in flags
        ):
            raise ValueError(f"engine_flags must be (flag, value) pairs of strings, got {flags!r}")
        for name in ("start_timeout_s", "control_timeout_s", "keepalive_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= MAX_WAIT_S:
                raise ValueError(
                    f"{name} must be a finite number of seconds in (0, {MAX_WAIT_S:g}], "
                    f"got {value!r}"
                )
        if self.keepalive_s >= self.control_timeout_s:
            raise ValueError(
                f"keepalive_s={self.keepalive_s} must be below "
                f"control_timeout_s={self.control_timeout_s}"
            )


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum``; else a ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def join_world(config: DistConfig, *, rank: int, local_rank: int) -> Any:
    """Join the world as ``rank`` (:func:`check_in` first, unless under torchrun, whose
    agent's store ``env://`` finds); return the gloo control group.

    Sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and
    ``LOCAL_RANK`` in this process first. On a CUDA machine the default
    group is ``cpu:gloo,cuda:nccl`` and this process takes ``cuda:<local_rank>``.
    """
    import torch
    import torch.distributed as dist

    os.environ.update(  # names: RENDEZVOUS_ENV
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(config.master_port),
        WORLD_SIZE=str(config.world_size),
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
    )
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    timeout = datetime.timedelta(seconds=config.start_timeout_s)
    # torchrun's agent hosts the store; otherwise rank 0 does, and every rank checks in
    # first (the same world size, a rank nobody holds), so that a mismatch is an error now
    where: dict[str, Any] = {"init_method": "env://"}
    if config.start_local:
        where = {"store": dist.PrefixStore("default_pg", check_in(config, rank=rank))}
    dist.init_process_group(
        backend, rank=rank, world_size=config.world_size, timeout=timeout, **where
    )
    if not config.start_local:
        agree(config, rank=rank)
    return dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=config.control_timeout_s)
    )


def agree(config: DistConfig, *, rank: int) -> None:
    """Under torchrun (whose agent hosts the store, so no :func:`check_in`): rank 0's
    Medha version, MODEL and engine flags go to every rank over the default group;
    each compares them with its own, and every rank hears every refusal.

    Raises :class:`JoinRefused` on every rank where any rank differs, naming each
    such rank and, for a flag, both values (as :func:`check_in` does).
    """
    import torch.distributed as dist

    box: list[Any] = [None]
    if rank == 0:
        box[0] = {**_facts(config), "model": config.model}
    dist.broadcast_object_list(box, src=0)
    where = f"{config.master_addr}:{config.master_port}"
    why = _other_version(box[0], rank, where)
    if why is None:
        why = _config_mismatch(config, rank, where, box[0]["model"], box[0])
    refusals: list[Any] = [None] * config.world_size
    dist.all_gather_object(refusals, why)
    said = [r for r in refusals if r]
    if said:
        raise JoinRefused("; ".join(said))


class JoinRefused(RuntimeError):
    """This rank cannot join the driver's world (another world size or ranks per node, or
    its rank taken)."""


#: the check-in keys on the rendezvous store (the default group's keys have a prefix)
_WORLD, _JOINED, _REFUSED = "medha/world", "medha/joined", "medha/refused"
#: what the driver publishes beyond ``_WORLD``'s ``[world, local_ranks, model]`` (which
#: keeps its layout, so that a node of an earlier Medha still reads it and joins as it
#: did): the check-in format, the Medha version and the engine flags
_FACTS = "medha/facts"


def check_in(config: DistConfig, *, rank: int) -> Any:
    """The rendezvous store (rank 0 hosts it), once every rank has checked in.

    Rank 0 publishes its world size, ranks per node (``local_ranks``), model and engine
    flags and waits until the other ``world_size - 1`` ranks have checked in; any other
    rank reads them, refuses to join where one differs from its own (naming each
    differing engine flag with both values), and claims its rank (a
    second claimant is refused: a node started twice with one ``--node-rank``).
    A refusal tells rank 0 too, which fails with the same reason while it waits.
    Raises :class:`JoinRefused` with the reason, also when the driver's store cannot
    be reached within ``start_timeout_s``.
    """
    import time

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=config.start_timeout_s)
    world, where = config.world_size, f"{config.master_addr}:{config.master_port}"
    try:
        store = dist.TCPStore(
            config.master_addr,
            config.master_port,
            None,
            rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as exc:
        if rank == 0:
            raise  # its own port (in use, say): torch's message says which
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise JoinRefused(
            f"cannot reach the driver at {where} within {config.start_timeout_s:.0f} s "
            f"({type(exc).__name__}: {first}): is node 0 started, with this address "
            "and port?"
        ) from None
    if rank == 0:
        store.set(_FACTS, json.dumps(_facts(config)))  # before _WORLD, which a node waits for
        store.set(_WORLD, json.dumps([world, config.local_ranks, config.model]))
        deadline = time.monotonic() + config.start_timeout_s
        while (joined := store.add(_JOINED, 0)) < world - 1:
            if store.check([_REFUSED]):
                raise JoinRefused(store.get(_REFUSED).decode())
            if time.monotonic() > deadline:
                raise JoinRefused(
                    f"{joined} of the {world - 1} other ranks joined at {where} within "
                    f"{config.start_timeout_s:.0f} s: start every node"
                )
            time.sleep(0.05)
        return store
    theirs, their_k, their_model = json.loads(store.get(_WORLD))
    facts = json.loads(store.get(_FACTS)) if store.check([_FACTS]) else None
    why = _other_version(facts, rank, where)
    if why is not None:
        store.set(_REFUSED, why)
        raise JoinRefused(why)
    if theirs != world:
        why = (
            f"rank {rank} of a world of {world} ranks cannot join the driver's world of "
            f"{theirs} ranks at {where}: every node needs the same layout "
            "(tp*spp*kvp) and node count"
        )
    elif their_k != config.local_ranks:
        why = (
            f"rank {rank} cannot join at {where}: its node runs {config.local_ranks} "
            f"rank(s) per node, the driver's {their_k} per node: every node needs the "
            "same node count"
        )
    else:
        why = _config_mismatch(config, rank, where, their_model, facts)
    if why is None and store.add(f"medha/rank/{rank}", 1) > 1:
        why = (
            f"rank {rank} has joined already at {where}: was another node started with "
            "the same node rank?"
        )
    if why is not None:
        store.set(_REFUSED, why)
        raise JoinRefused(why)
    store.add(_JOINED, 1)
    return store


#: the layout of the facts the driver publishes at check-in under ``_FACTS`` (a JSON
#: object; a driver of an earlier Medha publishes none)
CHECK_IN_FORMAT = 2


def _facts(config: DistConfig) -> dict[str, Any]:
    """What the driver tells the other ranks: the check-in format, its Medha version
    and its engine flags."""
    return {
        "format": CHECK_IN_FORMAT,
        "medha": medha_version(),
        "engine_flags": [list(pair) for pair in config.engine_flags],
    }


def _other_version(facts: Any, rank: int, where: str) -> str | None:
    """Why rank ``rank`` cannot read the driver's check-in ``facts`` (None: the driver
    published none, being of an earlier Medha; another check-in layout; another Medha
    version, where both know theirs: a source tree run uninstalled says "unknown"), or
    None."""
    mine = medha_version()
    if not isinstance(facts, dict) or facts.get("format") != CHECK_IN_FORMAT:
        theirs = facts.get("medha", "unknown") if isinstance(facts, dict) else "an older one"
        return (
            f"rank {rank} cannot join at {where}: the driver runs another Medha version "
            f"({theirs}; this node runs {mine} and cannot read its check-in): give every "
            "node the same Medha version"
        )
    if "unknown" not in (mine, facts.get("medha")) and facts.get("medha") != mine:
        return (
            f"rank {rank} cannot join at {where}: the driver runs Medha {facts.get('medha')}, "
            f"this node {mine}: give every node the same Medha version"
        )
    return None


def _config_mismatch(
    config: DistConfig, rank: int, where: str, their_model: Any, facts: dict
) -> str | None:
    """Why rank ``rank``'s MODEL or engine flags are not the driver's (its ``facts``), or
    None."""
    if None not in (config.model, their_model) and config.model != their_model:
        return (
            f"rank {rank} cannot join at {where}: its node was started with MODEL "
            f"{config.model!r}, but the driver serves {their_model!r} (every node runs "
            "the driver's MODEL, from the same path): give every node the same MODEL"
        )
    flags = _flag_differences(config.engine_flags, facts["engine_flags"])
    if flags:
        return (
            f"rank {rank} cannot join at {where}: its node was started with engine flags "
            f"other than the driver's (every node runs the driver's engine): {flags}: "
            "give every node the same engine flags"
        )
    return None


def _flag_differences(mine: Any, theirs: Any) -> str:
    """``"--tp 1 on this node, 2 on the driver; ..."`` for each engine flag whose value
    differs ("" where none does, or where either side sent none)."""
    if not mine or not theirs:
        return ""
    a, b = dict(mine), {str(k): str(v) for k, v in theirs}
    parts = [
        f"{flag} {_short(a.get(flag, 'unset'))} on this node, "
        f"{_short(b.get(flag, 'unset'))} on the driver"
        for flag in dict.fromkeys([*a, *b])
        if a.get(flag) != b.get(flag)
    ]
    return "; ".join(parts)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def build_rank(spec: Any) -> tuple[Any, Any, str | None]:
    """This rank's parallel state and runner for ``spec`` (a ``RunnerSpec``), after
    :func:`join_world`; returns ``(state, runner, None)`` or ``(state, None, error)``."""
    import traceback

    from medha_parallel import ParallelLayout, ParallelState
    from medha_runtime.runner import ModelRunner, resolve_device

    state = None
    try:
        layout = ParallelLayout(tp=spec.tp, spp=spec.spp, kvp=spec.kvp)
        # the world is joined already (gloo, or cpu:gloo,cuda:nccl on a CUDA machine)
        state = ParallelState.initialize(
            layout, device=resolve_device(spec.device), timeout_s=spec.timeout_s
        )
        return state, ModelRunner(spec, state), None
    except Exception:
        return state, None, traceback.format_exc()


def set_threads(spec: Any, local_world: int) -> None:
    """Torch CPU threads for one of ``local_world`` ranks on this node."""
    import torch

    threads = spec.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)


#: what :func:`join_world` sets in this process's environment
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def rendezvous_env() -> dict[str, str | None]:
    """This process's :data:`RENDEZVOUS_ENV` values now (None: unset), for :func:`restore_env`."""
    return {name: os.environ.get(name) for name in RENDEZVOUS_ENV}


def restore_env(saved: dict[str, str | None]) -> None:
    """Put the environment back as :func:`rendezvous_env` saw it, so that processes
    started later (a ``serve`` child, say) do not believe they run under torchrun."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def leave_world() -> None:
    """Destroy every process group of this process (errors ignored)."""
    import contextlib

    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
