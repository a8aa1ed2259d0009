"""Parallel training: choose DataParallel / DDP / FSDP2, set it up correctly, tear it down.

The decision is a pure function (:func:`choose_strategy`, the one behind
:func:`parallelize`), tested over every input; :func:`parallelize` only carries it
out (moves the model, initialises the process group, wraps) and logs it once.
Around it sit the helpers every DDP script needs: :func:`process_group`
(guaranteed teardown), :func:`launch` (N local processes with a torchrun-equivalent
environment), :func:`unwrap`, :func:`state_dict` / :func:`load_state_dict` (no
``module.`` prefix), :func:`rank`, :func:`world_size`, :func:`local_rank`,
:func:`is_main_process`, :func:`main_process_first` and :func:`distributed_loader`
(a rank's shard, ``set_epoch`` called for you).
:func:`recompute` trades compute for memory: blocks run their forward again in the
backward (also ``parallelize(model, recompute=...)``).
:func:`read_env` reads the launcher's environment (torchrun's or SLURM's) without
starting anything.
"""

# Modules, one concern each: strategy (the pure decisions), options (the wrapper
# options, checked), group (the process group's lifetime), ranks (who am I), launcher
# (launch), failures (which rank a failed launch blames), wrap (parallelize), unwrapped
# (unwrap, state dicts), recompute (activation recompute) and loaders. The launcher
# environment is read in cudakit._dist.

from .._dist import DistributedEnv, read_env
from ..exceptions import LaunchError
from .group import ProcessGroupInfo, process_group
from .launcher import launch
from .loaders import DistributedLoader, distributed_loader
from .meta import materialize
from .pretrained import PretrainedLoad, load_pretrained, save_pretrained
from .ranks import is_main_process, local_rank, main_process_first, rank, world_size
from .recompute import Recompute, recompute, recomputed_blocks
from .strategy import Strategy, StrategyRequest, choose_strategy
from .unwrapped import LoadResult, load_state_dict, state_dict, unwrap
from .wrap import parallelize

__all__ = [
    "DistributedEnv",
    "DistributedLoader",
    "LaunchError",
    "LoadResult",
    "PretrainedLoad",
    "ProcessGroupInfo",
    "Recompute",
    "Strategy",
    "StrategyRequest",
    "choose_strategy",
    "distributed_loader",
    "is_main_process",
    "launch",
    "load_pretrained",
    "load_state_dict",
    "local_rank",
    "main_process_first",
    "materialize",
    "parallelize",
    "process_group",
    "rank",
    "read_env",
    "recompute",
    "recomputed_blocks",
    "save_pretrained",
    "state_dict",
    "unwrap",
    "world_size",
]
