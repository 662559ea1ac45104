"""keras.utils for meshtune."""
from meshtune import _checks

_seed = None


def set_random_seed(seed):
    """Seeds what meshtune draws at random: LoRA's A initialisation, the data shuffle and the samplers."""
    global _seed
    _seed = _checks.integer("seed", seed, 0, 2**64 - 1)


def random_seed():
    return _seed
