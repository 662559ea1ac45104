"""keras.mixed_precision and keras.config's floatx for meshtune: the dtype policy the next
from_preset loads under — "float32", "mixed_bfloat16" (fp32 variables, bf16 matmuls: train
faster) or, through set_floatx("bfloat16"), "bfloat16" (bf16 weights: serve)."""
from meshtune import _checks

_policy = "float32"
_POLICIES = ("float32", "mixed_bfloat16", "bfloat16")


class DTypePolicy:
    def __init__(self, name):
        _checks.string("policy", name)
        if name not in _POLICIES:
            if name in ("mixed_float16", "float16"):
                raise NotImplementedError(f"dtype policy {name!r} is not implemented by meshtune (use mixed_bfloat16)")
            raise ValueError(f"unknown dtype policy {name!r} (float32, mixed_bfloat16 or bfloat16)")
        self.name = name

    @property
    def compute_dtype(self):
        return "float32" if self.name == "float32" else "bfloat16"

    @property
    def variable_dtype(self):
        return "bfloat16" if self.name == "bfloat16" else "float32"

    def __repr__(self):
        return f'<DTypePolicy "{self.name}">'


Policy = DTypePolicy


def set_global_policy(policy):
    global _policy
    _policy = (policy if isinstance(policy, DTypePolicy) else DTypePolicy(policy)).name


def global_policy():
    return DTypePolicy(_policy)
