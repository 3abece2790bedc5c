"""What a kernel variant is: the object each device's kernels are (``cpu.variants``,
``gpu.variants``) and :mod:`.dispatch` chooses among.

A :class:`Kernel` declares what it takes (dtypes, head dims, layouts, kv cache forms, machine
features, the config switch that turns it off) and, for what a declaration cannot say, its
:meth:`Kernel.conditions` on the planned problem and its target's situation; it says which
fallbacks can change what runs (:meth:`Kernel.fallbacks`), and prepares its own launch
(:meth:`Kernel.prepare`), which runs its own compiled code.
"""
import dataclasses

from . import config
from .numerics.dtypes import dtype_name

FLOATS = ("float16", "bfloat16", "float32")
HALVES = ("float16", "bfloat16")
#: the forms of fused_infer_attention_score's kv cache a kernel may walk, in words (contiguous
#: and left-padded key / value every kernel reads)
CACHE_FORMS = {"paged": "a paged kv cache", "prefix": "a shared prefix",
               "int8": "an int8 kv cache"}
#: the score terms the SDPA drop-in adds to the operators' (extensions, in a problem's
#: ``softcap`` and ``sinks``)
EXTENSIONS = {"softcap": "softcapped scores", "sinks": "attention sinks"}


def cache_forms(problem):
    """The :data:`CACHE_FORMS` of planned problem ``problem``'s kv cache."""
    c = problem.cache
    if c is None:
        return ()
    present = {"paged": c.block_table is not None, "prefix": c.P > 0,
               "int8": c.antiquant is not None}
    return tuple(form for form in CACHE_FORMS if present[form])


def extensions(problem):
    """The :data:`EXTENSIONS` planned problem ``problem`` takes."""
    present = {"softcap": problem.softcap != 0, "sinks": problem.sinks is not None}
    return tuple(x for x in EXTENSIONS if present[x])


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel variant: the device it runs on, what it does, what it takes; subclasses say
    what a declaration cannot (:meth:`conditions`), which fallbacks can change what runs
    (:meth:`fallbacks`) and how it runs (:meth:`prepare`)."""
    name: str
    does: str                                 # in a line, for explanations and ``info``
    dtypes: tuple = FLOATS + ("int8",)        # query storage
    head_dims: tuple = ()                     # (): any the contract allows
    own_value_head_dim: bool = False          # takes a value head dim Dv other than D
    layouts: tuple = ()                       # (): any
    caches: tuple = tuple(CACHE_FORMS)
    features: tuple = ()                      # of the machine (Target.features)
    extensions: tuple = tuple(EXTENSIONS)     # of the SDPA drop-in's score terms it computes
    switch: str = ""                          # the config attribute that turns it off
    device = ""                               # 'cpu' or 'cuda' (each subclass's)
    operation = "forward"                     # or 'backward' (the SDPA drop-in's gradients)

    def not_supported_reasons(self, problem=None, situation=None, features=()):
        """Why this kernel cannot run planned problem ``problem`` (None: any problem) on a
        machine with ``features``: [] when it can."""
        reasons = [f"needs {f}, which this machine lacks" for f in self.features
                   if f not in features]
        if self.switch and not getattr(config, self.switch):
            reasons.append(f"config.{self.switch} is False")
        if problem is None:
            return reasons
        dtype = dtype_name(problem.dtype)
        if dtype not in self.dtypes:
            reasons.append(f"{dtype} inputs (it takes {', '.join(self.dtypes)})")
        if self.head_dims and problem.D not in self.head_dims:
            reasons.append(f"head dim {problem.D} (it takes "
                           f"{', '.join(map(str, self.head_dims))})")
        if problem.Dv != problem.D and not self.own_value_head_dim:
            reasons.append(f"value head dim Dv = {problem.Dv} with head dim D = {problem.D} "
                           f"(it takes Dv = D)")
        if self.layouts and problem.layout not in self.layouts:
            reasons.append(f"layout {problem.layout} (it takes {', '.join(self.layouts)})")
        reasons += [f"{CACHE_FORMS[form]} (it reads contiguous key / value)"
                    for form in cache_forms(problem) if form not in self.caches]
        reasons += [f"{EXTENSIONS[x]} (it does not compute them)"
                    for x in extensions(problem) if x not in self.extensions]
        if not reasons:
            reasons += self.conditions(problem, situation)
        return reasons

    def conditions(self, problem, situation):
        """Why this kernel cannot run planned problem ``problem`` in its target's
        ``situation``, beyond what it declares: [] when it can."""
        return []

    def fallbacks(self, problem, situation):
        """What, when this kernel runs ``problem``, can run instead of it or beside it, in
        words: [] when nothing can."""
        return []

    def prepare(self, problem, situation, staged=None):
        """This kernel's launch of planned problem ``problem`` (its ``run`` computes it)."""
        raise NotImplementedError
