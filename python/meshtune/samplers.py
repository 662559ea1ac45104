"""keras_hub.samplers for meshtune: greedy, top-k, top-p and random (spec §6)."""
from meshtune import _checks


class Sampler:
    name = "greedy"

    def __init__(self, temperature=1.0):
        self.temperature = _checks.number("temperature", temperature, positive=True)

    def _options(self):
        return {"sampler": self.name, "temperature": self.temperature}


class GreedySampler(Sampler):
    name = "greedy"


class TopKSampler(Sampler):
    name = "top_k"

    def __init__(self, k=5, seed=None, temperature=1.0):
        super().__init__(temperature)
        self.k = _checks.integer("k", k, 1, 1 << 24)
        self.seed = None if seed is None else _checks.integer("seed", seed, 0)

    def _options(self):
        return {**super()._options(), "top_k": self.k, "seed": self.seed}


class TopPSampler(Sampler):
    name = "top_p"

    def __init__(self, p=0.1, k=None, seed=None, temperature=1.0):
        super().__init__(temperature)
        if k is not None:
            raise NotImplementedError("TopPSampler: k= is not implemented by meshtune")
        self.p = _checks.number("p", p, positive=True)
        if self.p > 1:
            raise ValueError(f"TopPSampler: p must be in (0, 1], got {self.p}")
        self.seed = None if seed is None else _checks.integer("seed", seed, 0)

    def _options(self):
        return {**super()._options(), "top_p": self.p, "seed": self.seed}


class RandomSampler(Sampler):
    name = "random"

    def __init__(self, seed=None, temperature=1.0):
        super().__init__(temperature)
        self.seed = None if seed is None else _checks.integer("seed", seed, 0)

    def _options(self):
        return {**super()._options(), "seed": self.seed}


_BY_NAME = {"greedy": GreedySampler, "top_k": TopKSampler, "top_p": TopPSampler, "random": RandomSampler}


def get(identifier):
    if isinstance(identifier, Sampler):
        return identifier
    if isinstance(identifier, str):
        if identifier in _BY_NAME:
            return _BY_NAME[identifier]()
        if identifier in ("beam", "contrastive"):
            raise NotImplementedError(f"sampler {identifier!r} is not implemented by meshtune")
        raise ValueError(f"unknown sampler {identifier!r} (greedy, top_k, top_p or random)")
    raise TypeError(f"sampler must be a name or a meshtune.samplers.Sampler, got {type(identifier).__name__}")
