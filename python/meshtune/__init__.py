"""meshtune: run and fine-tune Gemma with Keras' and KerasHub's names over a native engine.

The Keras tutorial "distributed tuning with Gemma" runs with its imports changed to

    import meshtune as keras
    import meshtune as keras_nlp

on one process or under `mpirun -np N python3 script.py` (the mesh's devices are the processes).
"""
from meshtune._engine import engine as _engine
from meshtune import (callbacks, config, datasets, distribution, losses, metrics, mixed_precision, models,
                      optimizers, samplers, utils)
from meshtune.models import Gemma3CausalLM, GemmaBackbone, GemmaCausalLM

__version__ = "0.1.0"

__all__ = ["callbacks", "config", "datasets", "distribution", "losses", "metrics", "mixed_precision", "models",
           "optimizers", "samplers", "utils", "GemmaCausalLM", "Gemma3CausalLM", "GemmaBackbone"]
