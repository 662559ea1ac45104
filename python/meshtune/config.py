"""keras.config for meshtune: floatx (set_floatx("bfloat16") loads the next model in bf16, Keras'
way to serve at half the memory)."""
from meshtune import mixed_precision


def set_floatx(value):
    if value not in ("float32", "bfloat16"):
        raise ValueError(f"set_floatx: expected float32 or bfloat16, got {value!r}")
    mixed_precision.set_global_policy(value)


def floatx():
    return "bfloat16" if mixed_precision.global_policy().name == "bfloat16" else "float32"


def set_dtype_policy(policy):
    mixed_precision.set_global_policy(policy)


def dtype_policy():
    return mixed_precision.global_policy()
