"""Sync schemes: device transforms, host protocols, rounds that connect them, and a registry.

``schemes/<name>/``: one package per built-in scheme, with its ``protocol.py`` (a
plain-Python state machine deciding who waits and when servers apply or forward; no JAX),
its ``transform.py`` (an optax-style ``GradientTransformationExtraArgs`` from per-worker
gradients ``[W, ...]`` to per-replica updates ``[R, ...]`` with explicit staleness state) and
its registration. ``protocol``: the protocols' base class and messages. ``transforms``: the
machinery the transforms share (the server's core, masks, staleness clocks, the replicas'
optimizer). ``rounds``: the fixed-shape record of one event and ``apply_round``, the pure step
an executor replays. ``timeline``: a discrete-event run of a protocol over given times.
``registry``: config names to (transform, protocol).
"""

from gssp_jax.sync.grouping import make_groups
from gssp_jax.sync.protocol import Message
from gssp_jax.sync.protocol import Protocol
from gssp_jax.sync.protocol import Reaction
from gssp_jax.sync.schemes.casp.protocol import ActorCritic
from gssp_jax.sync.schemes.casp.protocol import CASPProtocol
from gssp_jax.sync.schemes.dssync.protocol import dssync_partition
from gssp_jax.sync.schemes.dssync.protocol import DSSyncProtocol
from gssp_jax.sync.schemes.gssp.protocol import GSSPProtocol
from gssp_jax.sync.schemes.inhad.protocol import InHADProtocol
from gssp_jax.sync.schemes.ssp.protocol import ASPProtocol
from gssp_jax.sync.schemes.ssp.protocol import BSPProtocol
from gssp_jax.sync.schemes.ssp.protocol import DSSPProtocol
from gssp_jax.sync.schemes.ssp.protocol import SSPProtocol
from gssp_jax.sync import schemes
from gssp_jax.sync.registry import build_scheme
from gssp_jax.sync.registry import register_scheme
from gssp_jax.sync.registry import scheme_names
from gssp_jax.sync.registry import unregister_scheme
from gssp_jax.sync.registry import Scheme
from gssp_jax.sync.registry import scheme_from_config
from gssp_jax.sync.registry import SCHEMES
from gssp_jax.sync.rounds import apply_round
from gssp_jax.sync.rounds import Round
from gssp_jax.sync.rounds import round_args
from gssp_jax.sync.rounds import stack_rounds
from gssp_jax.sync.timeline import run_timeline
from gssp_jax.sync.timeline import Timeline
from gssp_jax.sync.timeline import TimelineEngine
from gssp_jax.sync import accounting
from gssp_jax.sync import legs
from gssp_jax.sync import local
from gssp_jax.sync.local import LocalUpdate
from gssp_jax.sync.schemes.casp.transform import casp
from gssp_jax.sync.schemes.dssync.transform import dssync
from gssp_jax.sync.schemes.gssp.transform import GSSPState
from gssp_jax.sync.schemes.gssp.transform import gssp
from gssp_jax.sync.schemes.inhad.transform import inhad
from gssp_jax.sync.schemes.inhad.transform import InHADState
from gssp_jax.sync.schemes.ssp.transform import asp
from gssp_jax.sync.schemes.ssp.transform import bsp
from gssp_jax.sync.schemes.ssp.transform import dssp
from gssp_jax.sync.schemes.ssp.transform import ssp
from gssp_jax.sync.transforms import clocks
from gssp_jax.sync.transforms import find_sync_state
from gssp_jax.sync.transforms import replicated
from gssp_jax.sync.transforms import ServerState
from gssp_jax.sync.transforms import staleness
from gssp_jax.sync.transforms import versions

__all__ = [   # the package's public names, re-exported
    "make_groups",
    "Message",
    "Protocol",
    "Reaction",
    "ActorCritic",
    "CASPProtocol",
    "dssync_partition",
    "DSSyncProtocol",
    "GSSPProtocol",
    "InHADProtocol",
    "ASPProtocol",
    "BSPProtocol",
    "DSSPProtocol",
    "SSPProtocol",
    "build_scheme",
    "register_scheme",
    "scheme_names",
    "unregister_scheme",
    "Scheme",
    "scheme_from_config",
    "SCHEMES",
    "apply_round",
    "Round",
    "round_args",
    "stack_rounds",
    "run_timeline",
    "Timeline",
    "TimelineEngine",
    "accounting",
    "legs",
    "local",
    "schemes",
    "LocalUpdate",
    "asp",
    "bsp",
    "casp",
    "clocks",
    "dssp",
    "dssync",
    "find_sync_state",
    "GSSPState",
    "gssp",
    "inhad",
    "InHADState",
    "replicated",
    "ServerState",
    "ssp",
    "staleness",
    "versions",
]
