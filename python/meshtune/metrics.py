"""keras.metrics for meshtune: the accuracy KerasHub's causal LMs report."""


class SparseCategoricalAccuracy:
    def __init__(self, name="sparse_categorical_accuracy", dtype=None):
        self.name = name
