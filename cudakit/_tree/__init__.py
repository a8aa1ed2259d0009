"""The one walker over user data: shape-preserving moves of nested containers.

:mod:`.walk` dispatches and walks the containers; :mod:`.context` holds the state of
one walk, :mod:`.errors` its errors and cycle guard; :mod:`.tensors` copies tensors,
:mod:`.rebuild` rebuilds containers and objects, :mod:`.duck_typed` calls an object's
own ``.to()``, :mod:`.registered` handles registered types; :mod:`.probe` warns about
tensors left behind, :mod:`.refusals` refuses loaders and iterators, :mod:`.leaves`
lists the values that are never walked, and :mod:`.scans` holds prefetch's scans.
"""

from .context import Ctx, Staging
from .errors import Bad, located
from .scans import all_on_cpu, device_tensors_in
from .walk import add_special, finish, forget_warnings, move, move_root, register, traverse

__all__ = [
    "Bad",
    "Ctx",
    "Staging",
    "add_special",
    "all_on_cpu",
    "device_tensors_in",
    "finish",
    "forget_warnings",
    "located",
    "move",
    "move_root",
    "register",
    "traverse",
]
