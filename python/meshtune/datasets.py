"""Training data from files, for fit() and evaluate(): what the command line's --data reads.

    load("tfrecord:~/tensorflow_datasets/imdb_reviews/plain_text/1.0.0")  # tfds' files, no TensorFlow
    load("aclimdb:aclImdb"), load("chat.jsonl"), load("sample")           # kinds as `meshtune finetune --data`
"""
import os

from meshtune import _checks
from meshtune._engine import engine


def load(spec, text_field="text", prompt_field="prompts", response_field="responses"):
    spec = _checks.path("spec", spec)
    kind, sep, rest = spec.partition(":")
    if sep and kind in ("tfrecord", "aclimdb", "jsonl", "text", "npy"):
        spec = kind + ":" + os.path.expanduser(rest)
    else:
        spec = os.path.expanduser(spec)
    return engine.Dataset.load(spec, _checks.string("text_field", text_field),
                               _checks.string("prompt_field", prompt_field),
                               _checks.string("response_field", response_field))


def imdb_reviews(path):
    """tfds' imdb_reviews train split from its TFRecord files (a file or a directory of them)."""
    return load("tfrecord:" + _checks.path("path", path))
